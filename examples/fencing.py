"""The correctness path: the lock gives a token, the resource checks it.

Two holders of one lock name write to a SQLite "ledger". The first holder's lease is lost
(we force it, as a long pause would); the second acquires with a larger token and writes.
The first holder's late write carries the old token, so the fence rejects it and nothing
is written. Run: uv run python examples/fencing.py
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import anyio

import asynclock
import asynclock.testing
from asynclock.fence import SQLFence


def write(db: Path, fence: SQLFence, token: int, text: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        with fence.sqlite_transaction(conn, "ledger", token):
            conn.execute("INSERT INTO ledger (token, text) VALUES (?, ?)", (token, text))
    finally:
        conn.close()


async def main(tmp: Path) -> list[tuple[int, str]]:
    db = tmp / "resource.db"
    fence = SQLFence()
    with sqlite3.connect(db) as conn:
        fence.create_sqlite(conn)
        conn.execute("CREATE TABLE ledger (token INTEGER, text TEXT)")

    async with asynclock.connect(f"sqlite:///{tmp / 'locks.db'}") as backend:
        first = await backend.acquire("ledger", ttl=0.5)
        write(db, fence, first.token, "first holder, on time")
        asynclock.testing.force_loss(first, "pretend a long GC pause")  # stops renewing

        async with backend.lock("ledger", ttl=5.0, timeout=5) as second:
            write(db, fence, second.token, "second holder")
            print(f"second holder wrote with token {second.token}")

        try:
            write(db, fence, first.token, "first holder, too late")
        except asynclock.StaleToken as stale:
            print(f"late write rejected: {stale}")
        await first.release()  # a reported no-op: the lease is already lost

    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT token, text FROM ledger ORDER BY rowid").fetchall()
    for token, text in rows:
        print(f"ledger: token {token}: {text}")
    return rows


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
