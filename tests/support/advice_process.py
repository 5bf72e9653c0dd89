"""A process that holds locks with advice collected and serves its stats (for
``tests/conformance/test_advice.py``): ``python -m tests.support.advice_process URL ADDRESS HOLDS``.

It makes HOLDS short holds of ``job:N`` and holds ``slow:1`` (ttl 0.15 s) until the renewer
has run 25 rounds, then prints one JSON line (the address bound, its own figures) and
serves until stdin closes.
"""

from __future__ import annotations

import json
import sys

import anyio
import anyio.lowlevel

import asynclock
from asynclock.testing import next_renewal_round


async def main(url: str, address: str, holds: int) -> None:
    async with asynclock.connect(url) as backend:
        backend.collect_advice()
        for i in range(holds):
            async with backend.lock(f"job:{i}", ttl=5.0):
                await anyio.lowlevel.checkpoint()
        async with backend.lock("slow:1", ttl=0.15):
            for _ in range(25):
                with anyio.fail_after(10):
                    await next_renewal_round(backend)
        async with asynclock.serve_stats(backend, address) as bound:
            advice = backend.advise("job:1")
            print(json.dumps({"address": bound, "advice": advice.as_dict()}), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
