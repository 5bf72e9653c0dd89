"""At most N at once across every process that shares the backend: a counting semaphore.

Run: ``python examples/semaphore.py [URL]`` (default: a SQLite file in a temp dir; any of
memory://, sqlite://, redis:// or postgresql:// works). Six workers share two "GPU" slots;
each permit says which slot it holds and that slot's fencing token.
"""

from __future__ import annotations

import sys
import tempfile

import anyio

import asynclock


async def main(url: str) -> None:
    async with asynclock.connect(url) as backend:
        gpus = backend.semaphore("gpu", 2)
        in_use: set[int] = set()
        most = 0

        async def job(n: int) -> None:
            nonlocal most
            async with gpus.acquire(ttl=10, timeout=30) as permit:
                in_use.add(permit.slot)
                most = max(most, len(in_use))
                print(f"job {n} on gpu slot {permit.slot} with token {permit.token}")
                await anyio.sleep(0.05)  # the work; cancelled if the permit is lost
                in_use.discard(permit.slot)

        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(job, n)
        print(f"at most {most} jobs ran at once (limit 2)")
        async with gpus.acquire(ttl=10), gpus.acquire(ttl=10):
            try:
                async with gpus.acquire(ttl=10, blocking=False):
                    pass
            except asynclock.LockHeld:
                print("a third permit was refused while two were held")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            anyio.run(main, f"sqlite:///{tmp}/locks.db")
