"""An operator finds a stuck holder and breaks its lock; the holder's token stays fenced off.

A nightly job is guarded with ``@backend.locked_function``; one run hangs. From another
backend (as from another process), the operator asks who holds the lock, breaks it, and
the next run gets a larger token, so a late write from the stuck run is still refused by
any fence.

Run: uv run python examples/stuck_holder.py [URL]   (default: a SQLite file in a temp dir)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

import asynclock


async def main(url: str) -> None:
    async with asynclock.connect(url) as worker, asynclock.connect(url) as operator:
        started = anyio.Event()

        @worker.locked_function("nightly:{day}", ttl=5.0)
        async def nightly(day: str, *, hang: bool = False) -> int:
            lease = asynclock.current_lease()
            started.set()
            if hang:
                await anyio.sleep_forever()  # stuck: an await that never answers
            return lease.token

        async def stuck_run() -> None:
            try:
                await nightly("2026-12-01", hang=True)
            except asynclock.LeaseLost as lost:
                print(f"stuck run stopped: {lost.reason}")

        async with anyio.create_task_group() as tg:
            tg.start_soon(stuck_run)
            await started.wait()
            holder = await operator.holder("nightly:2026-12-01")
            assert holder is not None
            stuck_token = holder.token or 0
            print(f"held by token {stuck_token}")
            print(f"broken: {await operator.break_lock('nightly:2026-12-01')}")
        token = await nightly("2026-12-01")
        assert token > stuck_token
        print(f"next run got token {token} (larger: the stuck run's writes stay fenced off)")
        print(f"still locked: {await operator.locked('nightly:2026-12-01')}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        default = f"sqlite:///{Path(tmp) / 'locks.db'}"
        anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else default)
