"""A payment endpoint with an ``Idempotency-Key`` header (``@locks.idempotent``).

A client that retries after a timeout (or a user who presses "pay" twice) sends the same
key again: the payment runs once, and every retry gets its first answer, byte for byte,
marked ``Idempotent-Replayed: true``. The same key with another amount is 422; no key is
400. The key's record lives in a SQLite lock file in a temp dir:

    uv run python examples/fastapi_idempotent.py
"""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

import anyio
import httpx
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

import asynclock
from asynclock_fastapi import Locks, install


class Payment(BaseModel):
    order: str
    amount: int


def make_app(locks: Locks) -> FastAPI:
    app = install(FastAPI(lifespan=locks.lifespan))  # install(): idempotent routes need it
    charged: list[int] = []

    @app.post("/payments", status_code=201)
    @locks.idempotent(ttl=10)  # keep=86400 (24 h), Idempotency-Key required
    async def pay(payment: Payment) -> dict[str, int | str]:
        # Runs under the key's lease: asynclock.current_lease().token fences what it writes.
        charged.append(payment.amount)
        token = asynclock.current_lease().token
        return {"order": payment.order, "charge": len(charged), "token": token}

    return app


async def main(directory: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    locks = Locks(f"sqlite:///{directory / 'locks.db'}")
    server = uvicorn.Server(uvicorn.Config(make_app(locks), log_level="warning"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: server.serve(sockets=[sock]))
        # uvicorn offers no start-up event to wait on; its `started` flag is polled.
        while not server.started:  # noqa: ASYNC110
            await anyio.sleep(0.01)

        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            key = {"Idempotency-Key": '"order-7-attempt"'}
            payment = {"order": "7", "amount": 250}
            first = await client.post("/payments", json=payment, headers=key)
            print(f"first: {first.status_code} {first.text}")
            retry = await client.post("/payments", json=payment, headers=key)
            replayed = retry.headers.get("Idempotent-Replayed")
            print(f"retry: {retry.status_code} {retry.text} (Idempotent-Replayed: {replayed})")
            print(f"same bytes: {retry.content == first.content}")
            other = await client.post("/payments", json={**payment, "amount": 999}, headers=key)
            print(f"same key, another amount: {other.status_code}")
            missing = await client.post("/payments", json=payment)
            print(f"no key: {missing.status_code}")

        server.should_exit = True


if __name__ == "__main__":
    if len(sys.argv) != 1:
        raise SystemExit("usage: fastapi_idempotent.py (no arguments)")
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
