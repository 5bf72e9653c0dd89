"""A guarded FastAPI route calling a fenced FastAPI service: both sides of the HTTP fence.

* ``holder``: ``POST /accounts/{account_id}/rebuild`` holds the lock ``account:{id}`` for
  the request (``@locks.guard``) and writes to the ledger with ``FencingAuth``, which
  sends the lease's token in the ``Fencing-Token`` header.
* ``ledger``: ``PUT /balances/{account_id}`` takes the token (``Depends(fenced_write)``)
  and applies it *in the write's transaction* (``SQLFence`` underneath): a stale token is
  412, a missing one 428, and nothing is written.

Runs both on loopback ports with a SQLite lock file and a SQLite ledger in a temp dir:

    uv run python examples/fastapi_app.py
"""

from __future__ import annotations

import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import httpx
import uvicorn
from fastapi import Depends, FastAPI
from pydantic import BaseModel

import asynclock
from asynclock.fence import SQLFence
from asynclock_fastapi import (
    FencedWrite,
    FencingAuth,
    Locks,
    fenced_write,
    guard_lease,
    install,
)


class Balance(BaseModel):
    total: int


def ledger_app(db: Path) -> FastAPI:
    """The protected resource: every write carries a token and is fenced atomically."""
    fence = SQLFence()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aiosqlite.connect(db) as conn:
            await conn.execute(fence.create_sql)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS balances (id TEXT PRIMARY KEY, total INT)"
            )
            await conn.commit()
        yield

    app = install(FastAPI(title="ledger", lifespan=lifespan))  # StaleToken -> 412

    @app.put("/balances/{account_id}")
    async def put_balance(
        account_id: str, balance: Balance, write: FencedWrite = Depends(fenced_write)
    ) -> dict[str, int]:
        async with aiosqlite.connect(db, isolation_level=None) as conn:
            await conn.execute("BEGIN IMMEDIATE")
            try:
                await write.aiosqlite(conn, f"balance:{account_id}")  # G8: in this transaction
                await conn.execute(
                    "INSERT INTO balances VALUES (?, ?) "
                    "ON CONFLICT (id) DO UPDATE SET total = excluded.total",
                    (account_id, balance.total),
                )
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            await conn.execute("COMMIT")
        return {"total": balance.total, "token": write.token}

    @app.get("/balances/{account_id}")
    async def get_balance(account_id: str) -> dict[str, Any]:
        async with aiosqlite.connect(db) as conn:
            cursor = await conn.execute("SELECT total FROM balances WHERE id = ?", (account_id,))
            row = await cursor.fetchone()
        return {"total": None if row is None else row[0]}

    return app


def holder_app(locks: Locks, ledger_url: str) -> FastAPI:
    """The lock holder: one rebuild per account at a time, its writes fenced downstream."""
    app = install(FastAPI(title="holder", lifespan=locks.lifespan))

    @app.post("/accounts/{account_id}/rebuild")
    @locks.guard("account:{account_id}", ttl=10)
    async def rebuild(
        account_id: str, lease: asynclock.Lease = Depends(guard_lease)
    ) -> dict[str, int]:
        total = 100 * len(account_id)  # the "expensive" rebuild
        async with httpx.AsyncClient(base_url=ledger_url, auth=FencingAuth()) as ledger:
            answer = await ledger.put(f"/balances/{account_id}", json={"total": total})
            answer.raise_for_status()
        return {"total": total, "token": lease.token}

    return app


def bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def main(directory: Path) -> None:
    ledger_sock, holder_sock = bound_socket(), bound_socket()
    ledger_url = f"http://127.0.0.1:{ledger_sock.getsockname()[1]}"
    holder_url = f"http://127.0.0.1:{holder_sock.getsockname()[1]}"
    locks = Locks(f"sqlite:///{directory / 'locks.db'}")
    servers = [
        uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        for app in (ledger_app(directory / "ledger.db"), holder_app(locks, ledger_url))
    ]
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: servers[0].serve(sockets=[ledger_sock]))
        tg.start_soon(lambda: servers[1].serve(sockets=[holder_sock]))
        # uvicorn offers no start-up event to wait on; its `started` flag is polled.
        while not all(server.started for server in servers):  # noqa: ASYNC110
            await anyio.sleep(0.01)

        async with httpx.AsyncClient(base_url=holder_url, timeout=30) as client:
            done = await client.post("/accounts/42/rebuild")
            token = int(done.headers["Fencing-Token"])
            print(f"rebuild: {done.status_code} {done.json()} (Fencing-Token {token})")

            # While someone else holds account:42, a rebuild is refused at once.
            async with locks.backend.lock("account:42", ttl=10) as other:
                busy = await client.post("/accounts/42/rebuild")
                print(f"rebuild while held: {busy.status_code} {busy.json()['detail']}")
                async with httpx.AsyncClient(base_url=ledger_url, auth=FencingAuth()) as ledger:
                    await ledger.put("/balances/42", json={"total": 7})  # carries other.token
            print(f"other holder wrote total=7 with token {other.token}")

        async with httpx.AsyncClient(base_url=ledger_url, timeout=30) as ledger:
            late = await ledger.put(
                "/balances/42", json={"total": 999}, headers={"Fencing-Token": str(token)}
            )
            print(f"late write with token {token}: {late.status_code} (stale, nothing written)")
            missing = await ledger.put("/balances/42", json={"total": 999})
            print(f"write without a token: {missing.status_code}")
            final = (await ledger.get("/balances/42")).json()
            print(f"ledger: balance 42 = {final['total']}")

        for server in servers:
            server.should_exit = True


if __name__ == "__main__":
    if len(sys.argv) != 1:
        raise SystemExit("usage: fastapi_app.py (no arguments)")
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
