"""The restart grace of the Redis backends (issue 21 item 1), with the documented defaults
on servers started just now: one end per database, bounded by the server's uptime, told
apart from a holder everywhere (errors, ``holder()``, ``locked()``) and logged once."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.backends.redis import RedisDriver, RedlockDriver, epoch_key
from asynclock.backends.redis.pubsub import Listener
from tests.support.redis_servers import RedisFactory, RedisServer, redlock_url, wait_until

pytestmark = pytest.mark.anyio


async def _uptime(server: RedisServer, client: redis.asyncio.Redis) -> int:
    return int((await client.info("server"))["uptime_in_seconds"])


def _grace_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "restart grace until" in r.getMessage()
    ]


async def test_a_fresh_server_has_one_grace_end_told_everywhere_and_logged_once(
    redis_factory: RedisFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Defaults, a server started just now. Before the fix: `LockHeld: ... held by
    another owner; it frees in at most 0.98s` while holder() was None and locked() False,
    and a second request with another ttl got another answer (each used its own ttl)."""
    caplog.set_level(logging.WARNING, "asynclock")
    server = redis_factory(fresh=True)
    started = time.time()
    async with asynclock.connect(server.url) as backend:
        with pytest.raises(asynclock.RestartGrace) as first:
            await backend.acquire("report", ttl=2.0, blocking=False)
        grace = first.value
        assert isinstance(grace, asynclock.LockHeld)  # code that treats busy as "later"
        assert "restart grace" in str(grace) and "held by another owner" not in str(grace)
        assert "restart without persistence" in str(grace)
        # Ends 2 s (the first ttl asked for) after the server started, not after the ask.
        assert started - 0.5 < grace.until - 2.0 <= time.time()
        assert grace.retry_after is not None and 0 < grace.retry_after <= 2.0
        # One end for the database: another name, another ttl, the same answer.
        with pytest.raises(asynclock.RestartGrace) as second:
            await backend.acquire("other", ttl=20.0, blocking=False)
        assert second.value.until == grace.until
        # holder() and locked() say the same, and why.
        seen = await backend.holder("report")
        assert seen is not None and seen.grace_until == grace.until
        assert seen.owner is None and seen.token is None
        assert seen.remaining is not None and 0 < seen.remaining <= 2.0
        assert await backend.locked("report")
        assert not await backend.validate("report", 1)
        # A blocking acquire waits for the end, then is granted.
        async with backend.lock("report", ttl=2.0, timeout=10) as lease:
            assert time.time() >= grace.until - 0.01
            assert lease.token > 0
        assert await backend.holder("other") is None  # the grace is over for every name
        assert not await backend.locked("other")
    warnings = _grace_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert server.url.split("//")[1].split("/")[0] in warnings[0]


async def test_a_timeout_during_the_grace_says_so(redis_factory: RedisFactory) -> None:
    server = redis_factory(fresh=True)
    async with asynclock.connect(server.url) as backend:
        with pytest.raises(asynclock.AcquireTimeout) as info:
            await backend.acquire("t", ttl=5.0, timeout=0.2)
    assert info.value.detail is not None and "restart grace" in info.value.detail
    assert "restart grace" in str(info.value)


async def test_a_server_up_longer_than_the_grace_waits_for_nothing(
    redis_factory: RedisFactory,
) -> None:
    """Before the fix a database used for the first time on a server up for days still
    waited its grace; so did every database after a FLUSHALL. Data cannot have been lost
    before the server started, so a server up longer than the grace has nothing to wait
    for (a FLUSHALL of live locks is an operator's act, like break_lock: see the docs)."""
    server = redis_factory(fresh=True)
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        # INFO counts whole seconds of the clock: once it says 2, the server is up > 1 s,
        # more than the grace.
        await wait_until(lambda: _up_at_least(server, client, 2), timeout=10)
        url = server.url[: -len("/0")] + "/3"  # a database never used before
        async with asynclock.connect(url, restart_grace=0.5) as backend:
            async with backend.lock("first", ttl=5.0, blocking=False) as lease:
                assert lease.token > 0
        async with asynclock.connect(server.url, restart_grace=0.5) as backend:
            await client.flushall()
            async with backend.lock("after-flush", ttl=5.0, blocking=False):
                pass
            assert await client.get(epoch_key()) is not None
    finally:
        await client.aclose()


async def _up_at_least(server: RedisServer, client: redis.asyncio.Redis, seconds: int) -> bool:
    return await _uptime(server, client) >= seconds


async def test_a_restart_without_persistence_starts_one_grace_from_the_restart(
    redis_factory: RedisFactory,
) -> None:
    """kill -9 and a restart that lost the data: the grace ends the first ttl asked for
    after the new server started (it is the only time data can have been lost)."""
    server = redis_factory()
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("r", ttl=1.5, blocking=False):
            pass
        server.restart(keep_data=False)
        restarted = time.time()
        with pytest.raises(asynclock.RestartGrace) as info:
            await backend.acquire("r", ttl=1.5, blocking=False)
        assert restarted - 1.0 < info.value.until - 1.5 <= time.time()
        with anyio.fail_after(10):
            async with backend.lock("r", ttl=1.5) as lease:
                assert time.time() >= info.value.until - 0.01
                assert lease.token > 0


async def test_a_grace_that_ended_is_kept_across_a_restart_with_persistence(
    redis_factory: RedisFactory,
) -> None:
    """Once its grace is over the epoch key holds "0" (the steady-state acquire then reads
    no TIME); a restart that kept the data (appendfsync always) keeps it, so it starts no
    grace, and the tokens go on from the kept counter."""
    server = redis_factory(persist=True, fresh=True)
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        async with asynclock.connect(server.url) as backend:
            with anyio.fail_after(10):
                async with backend.lock("p", ttl=0.5) as first:  # waits the 0.5 s grace
                    pass
            assert await client.get(epoch_key()) == b"0"
            server.restart(keep_data=True)  # returns once it answers PING
            async with backend.lock("p", ttl=0.5, blocking=False) as second:
                assert second.token == first.token + 1
    finally:
        await client.aclose()


async def test_a_grace_never_ends_before_the_grace_after_the_real_restart(
    redis_factory: RedisFactory,
) -> None:
    """INFO's uptime is whole seconds of the clock: a server started late in one second
    and asked early in the next says 1 while it has been up for a few ms. Taking now - 1 s
    as its start ended the grace almost a second early, while a holder from before the
    restart could still be working. The restart is timed to start just before a second
    ends and the acquire to come after it."""
    server = redis_factory()
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("r", ttl=1.5, blocking=False):
            pass
        for _ in range(10):  # a restart slower than the rest of the second: again
            await wait_until(lambda: 0.85 < time.time() % 1 < 0.9, timeout=5)
            before = time.time()
            server.restart(keep_data=False)
            if int(time.time()) == int(before):
                break
        else:
            pytest.fail("10 restarts each took more than 0.1 s")
        await wait_until(lambda: int(time.time()) > int(before), timeout=5)
        with pytest.raises(asynclock.RestartGrace) as info:
            await backend.acquire("r", ttl=1.5, blocking=False)
        assert info.value.until - 1.5 >= before - 0.002


async def test_redlock_reports_its_nodes_grace(redis_factory: RedisFactory) -> None:
    """Redlock on three nodes started just now: the quorum waits for their restart grace,
    and says so (error, holder, locked), then grants."""
    servers = redis_factory.many(3, fresh=True)
    async with asynclock.connect(redlock_url(servers), node_timeout=1.0) as backend:
        with pytest.raises(asynclock.RestartGrace) as info:
            await backend.acquire("job", ttl=1.5, blocking=False)
        seen = await backend.holder("job")
        assert seen is not None and seen.grace_until is not None and seen.owner is None
        assert abs(seen.grace_until - info.value.until) < 1.5
        assert await backend.locked("job")
        with anyio.fail_after(10):
            async with backend.lock("job", ttl=1.5) as lease:
                assert lease.token > 0
        assert await backend.holder("job") is None


@pytest.mark.parametrize("nodes", [1, 3], ids=["redis", "redlock"])
async def test_a_waiter_rides_out_a_restart_without_persistence(
    redis_factory: RedisFactory, nodes: int
) -> None:
    """A holder on one backend, a blocking waiter (``timeout=30``) on another, both with
    the defaults; the server is killed (kill -9, nothing persisted) and started again while
    the event loop runs. Before the fix the waiter failed at once with
    ``BackendUnavailable(... acquire failed: ConnectionError ...)``: the dropped pub/sub
    connection woke it and its retry met the server that was down. Now the holder loses
    its lease (the data is gone), the waiter is woken when the connection is back, waits
    the restart grace, and gets the lock."""
    servers = redis_factory.many(nodes)
    url = servers[0].url if nodes == 1 else redlock_url(servers)
    async with asynclock.connect(url) as holder_side, asynclock.connect(url) as waiter_side:
        listeners = _listeners(waiter_side)
        held = anyio.Event()
        outcome: dict[str, object] = {}

        async def hold() -> None:
            try:
                async with holder_side.lock("job", ttl=3.0, blocking=False):
                    held.set()
                    await anyio.sleep_forever()
            except asynclock.LeaseLost as exc:
                outcome["holder"] = exc

        async def wait() -> None:
            async with waiter_side.lock("job", ttl=3.0, timeout=30) as lease:
                outcome["waiter"] = lease.token

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await held.wait()
                tg.start_soon(wait)
                # The waiter was told no twice (the second time subscribed: a release
                # would reach it), so it sleeps until a wake-up, with no attempt in flight.
                await wait_until(
                    lambda: _busy_answers(waiter_side) >= 2 and all(n.confirmed for n in listeners),
                    timeout=10,
                )
                epochs = [listener.epoch for listener in listeners]
                for server in servers:
                    server.kill()
                # Every pub/sub connection saw its server go and failed to connect again
                # (two epochs: the drop, then a refused reconnect), while it was down.
                await wait_until(
                    lambda: all(n.epoch >= e + 2 for n, e in zip(listeners, epochs, strict=True)),
                    timeout=10,
                )
                restarted = time.time()
                for server in servers:
                    await anyio.to_thread.run_sync(functools.partial(server.start, settle=False))
        assert isinstance(outcome.get("holder"), asynclock.LeaseLost), outcome
        token = outcome.get("waiter")
        assert isinstance(token, int) and token > 0, outcome
        # It was granted after the grace (3 s, the first ttl asked for) from the restart.
        assert time.time() >= restarted + 3.0 - 1.0


def _busy_answers(backend: asynclock.Backend) -> int:
    return int(backend._acq.stats.busy_attempts)


def _listeners(backend: asynclock.Backend) -> list[Listener]:
    """The backend's pub/sub listeners (one per node): a peek at the internals, to know
    that the drop was seen before the servers come back."""
    driver = backend._acq.driver
    if isinstance(driver, RedlockDriver):
        return list(driver.listeners)
    assert isinstance(driver, RedisDriver)
    return [driver.listener]


async def test_a_restart_without_persistence_grants_no_permit_before_the_old_ones_end(
    redis_factory: RedisFactory,
) -> None:
    """Semaphores, as a new user meets them: documented defaults, a server started just
    now, a restart without persistence while a permit is held. The permit's row is gone
    with the data; its holder is cancelled at its next renewal, and no other permit is
    granted before that holder's lease has ended (the restart grace, as for locks: granted
    at once, limit 1 had two holders)."""
    server = redis_factory()
    async with asynclock.connect(server.url) as first, asynclock.connect(server.url) as other:
        events: list[str] = []
        with anyio.fail_after(30):
            with pytest.raises(asynclock.LeaseLost):
                async with first.semaphore("gpu", 1).acquire(ttl=2.0) as permit:
                    server.restart(keep_data=False)
                    with pytest.raises(asynclock.LockHeld):  # in the grace: nothing granted
                        async with other.semaphore("gpu", 1).acquire(ttl=2.0, blocking=False):
                            pytest.fail("a second permit of a limit of 1")
                    try:
                        await permit.lost
                    finally:
                        events.append("first cancelled")
            async with other.semaphore("gpu", 1).acquire(ttl=2.0, timeout=20) as second:
                events.append("second granted")
                assert second.token > permit.token
        assert events == ["first cancelled", "second granted"]


async def test_a_restart_without_persistence_grants_no_rwlock_hold_before_the_old_ones_end(
    redis_factory: RedisFactory,
) -> None:
    """As for permits: a writer held across a restart that lost the data is cancelled at
    its next renewal, and no other hold is granted before then (the restart grace)."""
    server = redis_factory()
    async with asynclock.connect(server.url) as first, asynclock.connect(server.url) as other:
        events: list[str] = []
        with anyio.fail_after(30):
            with pytest.raises(asynclock.LeaseLost):
                async with first.rwlock("table").write(ttl=2.0) as writer:
                    server.restart(keep_data=False)
                    with pytest.raises(asynclock.LockHeld, match="restart grace"):
                        async with other.rwlock("table").read(ttl=2.0, blocking=False):
                            pytest.fail("a reader beside a writer")
                    try:
                        await writer.lost
                    finally:
                        events.append("writer cancelled")
            async with other.rwlock("table").write(ttl=2.0, timeout=20) as second:
                events.append("second writer granted")
                assert second.token > writer.token
        assert events == ["writer cancelled", "second writer granted"]


async def test_a_restart_without_persistence_moves_no_partition_before_its_owner_lost_it(
    redis_factory: RedisFactory,
) -> None:
    """Partitions, as for permits: a group of two members on a server restarted without
    persistence. Every partition owned before the restart is lost by its owner before any
    member is granted one again (the restart grace); the group comes back whole, every new
    partition token above every old one."""
    server = redis_factory()
    async with (
        asynclock.connect(server.url) as a,
        asynclock.connect(server.url) as b,
        asynclock.connect(server.url) as c,
    ):
        events: list[str] = []
        whole = anyio.Event()
        with anyio.fail_after(40):
            async with (
                a.partitions("orders", count=4, ttl=2.0) as one,
                b.partitions("orders", count=4, ttl=2.0) as two,
            ):
                members = (one, two)

                async def follow(member: Any, other: Any, seen: set[int]) -> None:
                    async for _ in member.changes():
                        for p in member.owned():
                            if id(p) not in seen:
                                seen.add(id(p))
                                events.append(f"granted {p.id}")
                        if len(member.owned()) + len(other.owned()) == 4:
                            whole.set()

                async def lose(p: Any) -> None:
                    await p.lost
                    events.append(f"lost {p.id}")

                async with anyio.create_task_group() as tg:
                    seen: set[int] = set()
                    tg.start_soon(follow, one, two, seen)
                    tg.start_soon(follow, two, one, seen)
                    await whole.wait()
                    before = [p for m in members for p in m.owned()]
                    events.clear()
                    whole = anyio.Event()
                    async with anyio.create_task_group() as losses:
                        for p in before:
                            losses.start_soon(lose, p)
                        server.restart(keep_data=False)
                        # A member joining now takes free partitions at once, if granted.
                        async with c.partitions("orders", count=4, ttl=2.0) as three:
                            for p in three.owned():
                                events.append(f"granted {p.id}")
                    while sum(len(m.owned()) for m in members) < 4:
                        await whole.wait()
                        whole = anyio.Event()
                    tg.cancel_scope.cancel()
                after = [p for m in members for p in m.owned()]
        first_grant = min(i for i, e in enumerate(events) if e.startswith("granted"))
        assert sorted(events[:first_grant]) == sorted(f"lost {p.id}" for p in before)
        assert sorted(p.id for p in after) == [0, 1, 2, 3]
        assert min(p.token for p in after) > max(p.token for p in before)
