"""The correctness path on PostgreSQL: the lock gives a token, the table checks it.

Two holders of one lock name update an invoice in PostgreSQL. The first holder's lease is
lost (we force it, as a long pause would); the second acquires with a larger token and
writes. The first holder's late write carries the old token: the fence check, in the same
transaction as the write, raises StaleToken and the transaction rolls back.

Run against any PostgreSQL you can create tables in:

    uv run python examples/postgres_fenced_write.py postgresql://user:password@localhost/db
"""

from __future__ import annotations

import os
import sys

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock
import asynclock.testing
from asynclock.fence import SQLFence

fence = SQLFence()  # high-water marks in table asynclock_fence (key, token)


async def set_total(conn: asyncpg.Connection, token: int, total: int) -> None:
    async with conn.transaction():  # required: outside one, check_asyncpg raises
        await fence.check_asyncpg(conn, "invoice:42", token)  # the one line (G8)
        await conn.execute("UPDATE example_invoice SET total = $1 WHERE id = 42", total)


async def main(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        await fence.create_asyncpg(conn)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS example_invoice (id int PRIMARY KEY, total int)"
        )
        await conn.execute(
            "INSERT INTO example_invoice VALUES (42, 0) ON CONFLICT (id) DO UPDATE SET total = 0"
        )
        async with asynclock.connect(url) as backend:
            first = await backend.acquire("invoice:42", ttl=5.0)
            await set_total(conn, first.token, 100)
            print(f"first holder wrote 100 with token {first.token}")
            asynclock.testing.force_loss(first, "pretend a long GC pause")

            async with backend.lock("invoice:42", ttl=5.0, timeout=5) as second:
                await set_total(conn, second.token, 200)
                print(f"second holder wrote 200 with token {second.token}")

            try:
                await set_total(conn, first.token, 999)
            except asynclock.StaleToken as stale:
                print(f"late write rejected: {stale}")
            await first.release()  # a reported no-op: the lease is already lost
        total: int = await conn.fetchval("SELECT total FROM example_invoice WHERE id = 42")
        print(f"invoice total: {total}")
        return total
    finally:
        await conn.close()


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ASYNCLOCK_PG_URL", "")
    if not target:
        raise SystemExit("usage: postgres_fenced_write.py postgresql://user:password@host/db")
    anyio.run(main, target)
