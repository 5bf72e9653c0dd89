"""Many readers or one writer, across every process that shares the backend: a read-write
lock whose writer epoch fences stale readers.

Run: ``python examples/rwlock.py [URL]`` (default: a SQLite file in a temp dir; any of
memory://, sqlite://, redis:// or postgresql:// works). Readers share the catalog while a
writer waits for them, then rebuilds it alone; readers after it see the new epoch.
"""

from __future__ import annotations

import sys
import tempfile

import anyio

import asynclock


async def main(url: str) -> None:
    async with asynclock.connect(url) as backend:
        catalog = backend.rwlock("catalog")
        readers: set[int] = set()
        most = 0
        all_in = anyio.Event()

        async def reader(n: int) -> None:
            nonlocal most
            async with catalog.read(ttl=10, timeout=30):
                readers.add(n)
                most = max(most, len(readers))
                if len(readers) == 3:
                    all_in.set()
                await all_in.wait()  # the work; cancelled if the hold is lost
                readers.discard(n)

        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(reader, n)
        print(f"{most} readers held the catalog at once")

        async with catalog.read(ttl=10) as before:
            try:
                async with catalog.write(ttl=10, blocking=False):
                    pass
            except asynclock.LockHeld:
                print("a writer was refused while a reader held it")
        async with catalog.write(ttl=10) as w:
            print(f"the writer rebuilt the catalog alone: epoch {w.token} > {before.token}")
        async with catalog.read(ttl=10) as after:
            print(f"a reader after the write sees epoch {after.token}: {after.token == w.token}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            anyio.run(main, f"sqlite:///{tmp}/locks.db")
