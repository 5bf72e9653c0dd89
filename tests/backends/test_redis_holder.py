"""``holder()`` and ``break_lock()`` on a lock key asynclock did not write (another tool's,
or a legacy lock): reported as held with what is known, and breakable."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.backends.redis import keys_for
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.anyio


async def test_a_foreign_key_with_no_expiry(redis_server: RedisServer, lock_name: str) -> None:
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        await raw.set(keys_for(lock_name).lock, b"legacy-worker-7")  # no expiry, no token
        with anyio.fail_after(20):
            async with asynclock.connect(redis_server.url) as backend:
                holder = await backend.holder(lock_name)
                assert holder == asynclock.Holder(lock_name, "legacy-worker-7", None, None)
                assert await backend.locked(lock_name)
                assert await backend.break_lock(lock_name) is True
                assert await raw.exists(keys_for(lock_name).lock) == 0
                async with backend.lock(lock_name, ttl=5.0, blocking=False) as lease:
                    assert lease.token > 0
    finally:
        await raw.aclose()
