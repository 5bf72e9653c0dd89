"""ttl and max_hold from measured holds, and the same figures read by another process.

``backend.collect_advice()`` measures every hold per name template ("report:*") and every
renewal round; ``backend.advise(name)`` turns them into a ``max_hold`` (5 x the p99 hold)
and a ``ttl`` (from the tail of renewal round trips and event-loop lag; the hold time does
not matter, renewal extends the lease), saying how it got there. ``asynclock.serve_stats``
serves them as JSON on a loopback port (or a unix socket) for ``asynclock stats --from``,
``asynclock advise NAME --from`` or any HTTP client.

Run: uv run python examples/advice.py
"""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Any

import anyio
import anyio.to_thread

import asynclock
from asynclock.testing import next_renewal_round


async def main() -> None:
    async with asynclock.connect("memory://") as backend:
        backend.collect_advice()
        early = backend.advise("report:1")
        print(f"before any hold: {early.reasoning.split('. ')[0]}")

        for day in range(120):  # reports take 1-4 ms
            async with backend.lock(f"report:{day}", ttl=5.0):
                await anyio.sleep(random.uniform(0.001, 0.004))
        async with backend.lock("heartbeat:demo", ttl=0.15):  # renewed every 50 ms
            for _ in range(25):
                await next_renewal_round(backend)

        advice = backend.advise("report:7")
        print(
            f"advice for {advice.template!r}: max_hold={advice.max_hold}s ttl={advice.ttl}s "
            f"from {advice.samples} holds and {advice.renewal_samples} renewal rounds"
        )
        print(f"why: {advice.reasoning}")

        async with asynclock.serve_stats(backend, "127.0.0.1:0") as address:
            print(f"serving stats at {address}")

            def get(path: str) -> Any:
                with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as answer:
                    return json.load(answer)

            served = await anyio.to_thread.run_sync(get, "/advise?name=report:7")
            print(f"over HTTP: max_hold={served['max_hold']}s ttl={served['ttl']}s")
            stats = await anyio.to_thread.run_sync(get, "/")
            print(f"over HTTP: {stats['stats']['acquired']} leases acquired")


if __name__ == "__main__":
    anyio.run(main)
