"""The wait queue of a Redis semaphore (issue 42: first come, first served) as the server
keeps it: two sorted sets beside the permits' keys, in the name's hash slot, expiring a
week after the last place was kept and gone with their last place; a place whose expiry
key was lost (evicted apart from it) is dropped, never blocks the queue for ever."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.crc import key_slot

import asynclock
from asynclock._core.permit_store import Full, Granted, place_ttl
from asynclock.backends.redis.keys import keys_for
from asynclock.backends.redis.semaphore import place_keys, semaphore_keys
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.anyio

WEEK_MS = 7 * 24 * 3600 * 1000


@pytest.mark.parametrize("name", ["gpu", "{user1}:x", "}brace", "a{}b", "50%{x}", "ünï"])
def test_the_places_share_the_semaphores_hash_slot(name: str) -> None:
    keys = [*semaphore_keys(name, "asynclock:"), *place_keys(name, "asynclock:")]
    assert len(set(keys)) == 4
    # ... and the lock's slot, whose epoch key (on a cluster) the grant takes.
    assert {key_slot(k) for k in keys} == {key_slot(keys_for(name).lock.encode())}


async def _server_ms(client: redis.asyncio.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_places_expire_in_a_week_and_go_with_the_last_one(
    redis_server: RedisServer, lock_name: str
) -> None:
    q, qx = place_keys(lock_name, "asynclock:")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with asynclock.connect(redis_server.url) as backend:
            store = backend.semaphore(lock_name, 1)._store
            async with backend.semaphore(lock_name, 1).acquire(ttl=10) as holder:
                before = await _server_ms(client)
                assert isinstance(await store.grant("first", 1.0, queue=True), Full)
                assert isinstance(await store.grant("second", 1.0, queue=True), Full)
                after = await _server_ms(client)
                assert await client.zrange(q, 0, -1) == [b"first", b"second"]
                lapse = int(await client.zscore(qx, "first") or 0)  # by the server's TIME
                assert before + place_ttl(1.0) * 1000 <= lapse <= after + place_ttl(1.0) * 1000
                for key in (q, qx):
                    assert 0 < await client.pttl(key) <= WEEK_MS
                # Kept, not moved: "first" asks again, still ahead of "second".
                assert isinstance(await store.grant("first", 1.0, queue=True), Full)
                assert await client.zrange(q, 0, -1) == [b"first", b"second"]
                assert await holder.release() is True
            assert isinstance(await store.grant("second", 1.0), Full)  # "first" is ahead
            granted = await store.grant("first", 1.0, queue=True)
            assert isinstance(granted, Granted)
            assert await client.zrange(q, 0, -1) == [b"second"]  # a grant drops the place
            await store.withdraw("second")
            assert await client.exists(q, qx) == 0  # nothing left behind
            assert await store.release_permit("first", granted.slot, granted.token)
    finally:
        await client.aclose()


async def test_a_place_whose_expiry_was_evicted_is_dropped(
    redis_server: RedisServer, lock_name: str
) -> None:
    """The two keys are written together, but an eviction policy may drop one: a place
    with no expiry left is skipped at the next grant rather than ahead of everyone for
    ever (it only costs that waiter its place)."""
    q, qx = place_keys(lock_name, "asynclock:")
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        async with asynclock.connect(redis_server.url) as backend:
            store = backend.semaphore(lock_name, 1)._store
            async with backend.semaphore(lock_name, 1).acquire(ttl=10):
                assert isinstance(await store.grant("waiter", 10.0, queue=True), Full)
            assert await client.delete(qx) == 1
            async with backend.semaphore(lock_name, 1).acquire(ttl=10, blocking=False) as p:
                assert p.slot == 0
            assert await client.exists(q, qx) == 0
    finally:
        await client.aclose()
