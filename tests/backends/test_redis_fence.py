"""The Redis fence (G8): a stale token writes nothing and raises StaleToken."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.crc import key_slot

import asynclock
from asynclock.fence import RedisFence
from asynclock.fence.redis import mark_key
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.anyio


def test_mark_key_is_in_the_same_slot() -> None:
    for key in ["invoice:42", "{user1}:profile", "a{b}c"]:
        assert key_slot(mark_key(key).encode()) == key_slot(key.encode())
    with pytest.raises(ValueError, match="hash tag"):
        mark_key("a}b")


async def test_stale_writer_is_rejected_and_writes_nothing(
    redis_server: RedisServer, lock_name: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    fence = RedisFence()
    key = f"data:{lock_name}"
    async with asynclock.connect(redis_server.url) as backend:
        async with backend.lock(lock_name, ttl=5.0) as old:
            pass
        async with backend.lock(lock_name, ttl=5.0) as new:
            await fence.set(client, key, "new", new.token)
            await fence.set(client, key, "new-again", new.token)  # equal passes
        with pytest.raises(asynclock.StaleToken) as info:
            await fence.set(client, key, "old", old.token)
        assert info.value.current == new.token
        with pytest.raises(asynclock.StaleToken):
            await fence.delete(client, key, old.token)
        assert await client.get(key) == b"new-again"
        assert await fence.current(client, key) == new.token
        await fence.hset(client, key + ":h", {"a": "1", "b": 2}, new.token)
        assert await client.hgetall(key + ":h") == {b"a": b"1", b"b": b"2"}
        await client.script_flush()  # NOSCRIPT falls back to EVAL
        await fence.set(client, key, "px", new.token + 1, px=10_000)
        assert 0 < await client.pttl(key) <= 10_000
    await client.aclose()
