"""The smallest useful lock: one name, a ttl, and the fencing token you get for it.

Run: uv run python examples/basic.py [URL]   (default: a SQLite file in a temp dir)
Any backend URL works, e.g. zookeeper://127.0.0.1:2181 (pip install "asynclock[zookeeper]").
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio

import asynclock


async def main(url: str) -> None:
    async with asynclock.connect(url) as backend:
        async with backend.lock("report:daily", ttl=5.0) as lease:
            # Work here is cancelled if the lease is lost; the `async with` then raises
            # LeaseLost. Pass lease.token to every write this lock protects.
            print(f"holding {lease.name!r} with token {lease.token}")
            await anyio.sleep(0.1)
        async with backend.lock("report:daily", ttl=5.0) as again:
            print(f"holding it again with token {again.token} (always larger)")
        try:
            async with backend.lock("report:daily", ttl=5.0):
                async with backend.lock("report:daily", ttl=5.0, blocking=False):
                    pass
        except asynclock.LockHeld as busy:
            print(f"second holder refused: {busy}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        default = f"sqlite:///{Path(tmp) / 'locks.db'}"
        anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else default)
