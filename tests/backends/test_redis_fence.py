"""The Redis fence (G8): a stale token writes nothing and raises StaleToken."""

from __future__ import annotations

import uuid

import anyio
import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


#: Issue 8 item 2: pairs (newer, stale) that Lua doubles could not tell apart.
BOUNDARIES = [(2**53 + 1, 2**53), (2**63 - 1, 2**63 - 2), (10**16 + 1, 10**16), (10, 9)]


@pytest.mark.parametrize(("newer", "stale"), BOUNDARIES)
async def test_tokens_compare_exactly_up_to_2_63(
    redis_server: RedisServer, lock_name: str, newer: int, stale: int
) -> None:
    """A stale token above 2**53 was accepted and the mark went down; now it is refused."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    fence = RedisFence()
    key = f"data:{lock_name}"
    try:
        await fence.set(client, key, "newer", newer)
        with pytest.raises(asynclock.StaleToken) as info:
            await fence.set(client, key, "stale", stale)
        assert info.value.current == newer
        assert await client.get(key) == b"newer"
        assert await fence.current(client, key) == newer
        await fence.set(client, key, "again", newer)  # equal passes
        if newer < 2**63 - 1:
            await fence.check(client, key, newer + 1)
            assert await fence.current(client, key) == newer + 1
    finally:
        await client.aclose()


async def test_marks_written_by_earlier_versions_still_compare(
    redis_server: RedisServer, lock_name: str
) -> None:
    """Marks have always been plain decimal strings: one written before this fix (or with
    leading zeros) is read exactly, with no migration step."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    fence = RedisFence()
    key = f"data:{lock_name}"
    try:
        for old in ("9007199254740993", "0009007199254740993"):
            await client.set(mark_key(key), old)
            with pytest.raises(asynclock.StaleToken) as info:
                await fence.set(client, key, "x", 2**53)
            assert info.value.current == 2**53 + 1
            assert await fence.current(client, key) == 2**53 + 1
            await fence.set(client, key, "x", 2**53 + 1)
        assert await client.get(mark_key(key)) == b"9007199254740993"
    finally:
        await client.aclose()


@pytest.mark.parametrize("bad", ["abc", "1.5", "-3", " 12", "1e3", "", "1" * 20, "0x10"])
async def test_a_mark_that_is_not_a_token_is_a_clear_error(
    redis_server: RedisServer, lock_name: str, bad: str
) -> None:
    """Issue 8 item 15 (Redis): a raw ResponseError before; now a ValueError naming the mark,
    and nothing written."""
    client = redis.asyncio.Redis.from_url(redis_server.url)
    fence = RedisFence()
    key = f"data:{lock_name}"
    try:
        await client.set(key, "untouched")
        await client.set(mark_key(key), bad)
        with pytest.raises(ValueError, match=r"not a fencing token.*nothing was written"):
            await fence.set(client, key, "new", 5)
        with pytest.raises(ValueError, match=r"holds .* not a fencing token"):
            await fence.current(client, key)
        assert await client.get(key) == b"untouched"
        assert await client.get(mark_key(key)) == bad.encode()
        # The mark is a hash, or hset's data key a string: a TypeError, nothing written.
        await client.delete(mark_key(key))
        await client.hset(mark_key(key), "a", "1")
        with pytest.raises(TypeError, match=r"holds a Redis hash.*nothing was written"):
            await fence.set(client, key, "new", 5)
        with pytest.raises(TypeError, match="not a Redis string"):
            await fence.current(client, key)
        await client.delete(mark_key(key))
        with pytest.raises(TypeError, match="to be a Redis hash, it is a string"):
            await fence.hset(client, key, {"a": "1"}, 5)
        assert await client.exists(mark_key(key)) == 0
        assert await client.get(key) == b"untouched"
    finally:
        await client.delete(key, mark_key(key))
        await client.aclose()


_near = st.sampled_from([2**53, 10**16, 2**63 - 1, 2**32, 10**9, 10**15]).flatmap(
    lambda edge: st.integers(max(1, edge - 3), min(2**63 - 1, edge + 3))
)
TOKENS = st.one_of(st.integers(1, 2**63 - 1), _near, st.integers(1, 10**10))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.lists(TOKENS, min_size=2, max_size=6))
def test_fence_agrees_with_python_integer_order(
    redis_server: RedisServer, tokens: list[int]
) -> None:
    """Hypothesis: a sequence of writes is accepted exactly when Python's int order says the
    token is not below every token accepted before, and the mark is their maximum."""

    async def run() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        fence = RedisFence()
        key = f"sweep:{uuid.uuid4().hex}"
        high = 0
        try:
            for token in tokens:
                if token >= high:
                    await fence.set(client, key, str(token), token)
                    high = token
                else:
                    with pytest.raises(asynclock.StaleToken) as info:
                        await fence.set(client, key, str(token), token)
                    assert info.value.current == high
                assert await fence.current(client, key) == high
                assert await client.get(key) == str(high).encode()
        finally:
            await client.delete(key, mark_key(key))
            await client.aclose()

    anyio.run(run)
