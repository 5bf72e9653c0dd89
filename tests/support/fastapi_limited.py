"""A FastAPI app under ``@locks.limit`` in a process of its own (issue 42 item 5).

``python -m tests.support.fastapi_limited LOCK_URL PROBE_URL PORT`` serves
``POST /export/{key}`` (limit LIMIT, answers 429 at once when full) and
``POST /queue/{key}`` (the same limit, waits up to 30 s for a permit). Each request
counts itself in the probe Redis while in its endpoint: ``inside:<key>`` (now) and
``most:<key>`` (a list of what each request saw on entering), then sleeps ``hold``
seconds.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import redis.asyncio
import uvicorn
from fastapi import FastAPI

import asynclock
from asynclock_fastapi import Locks, current_permit

LIMIT = 2


def build(lock_url: str, probe_url: str) -> FastAPI:
    locks = Locks(lock_url)
    app = FastAPI(lifespan=locks.lifespan)
    probe = redis.asyncio.Redis.from_url(probe_url)

    async def work(key: str, hold: float) -> dict[str, Any]:
        permit = current_permit()
        assert asynclock.current_lease() is permit.lease
        inside = int(await probe.incr(f"inside:{key}"))
        await probe.rpush(f"most:{key}", inside)
        try:
            await anyio.sleep(hold)
        finally:
            await probe.decr(f"inside:{key}")
        return {"inside": inside, "slot": permit.slot, "token": permit.token}

    @app.post("/export/{key}")
    @locks.limit("export:{key}", LIMIT, ttl=5, retry_after=2)
    async def export(key: str, hold: float = 0.5) -> dict[str, Any]:
        return await work(key, hold)

    @app.post("/queue/{key}")
    @locks.limit("export:{key}", LIMIT, ttl=5, timeout=30)
    async def queue(key: str, hold: float = 0.2) -> dict[str, Any]:
        return await work(key, hold)

    return app


if __name__ == "__main__":
    lock_url, probe_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    uvicorn.run(build(lock_url, probe_url), host="127.0.0.1", port=port, log_level="warning")
