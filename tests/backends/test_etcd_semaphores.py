"""Semaphores and read-write locks on etcd (issue 42): what the conformance suite cannot
see — the key layout apart from locks, a session revoked at the server, the limit race,
renewal of many permits in one call, and the keys etcdctl shows."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

import asynclock
import asynclock.testing
from asynclock._core.permit_store import Full, Granted, OtherLimit, place_ttl
from asynclock.backends.etcd import EtcdDriver
from asynclock.backends.etcd import _proto as pb
from asynclock.backends.etcd._sem import permits_prefix, semaphore_prefix
from asynclock.backends.etcd.client import prefix_end
from tests.support.etcd_servers import EtcdCluster

pytestmark = pytest.mark.anyio


@pytest.fixture
async def etcd(etcd_cluster: EtcdCluster) -> AsyncIterator[asynclock.Backend]:
    async with asynclock.connect(etcd_cluster.url) as backend:
        yield backend


def etcd_driver(backend: asynclock.Backend) -> EtcdDriver:
    driver = backend.driver
    assert isinstance(driver, EtcdDriver)
    return driver


async def etcdctl(cluster: EtcdCluster, *args: str) -> str:
    return await anyio.to_thread.run_sync(lambda: cluster.etcdctl(*args))


async def test_permits_and_holds_are_not_locks(etcd: asynclock.Backend, lock_name: str) -> None:
    """Their keys are under asynclock's reserved prefix: a lock of the same name, or of a
    name that would prefix them, never sees them as holders, and the lock listing skips
    them."""
    with anyio.fail_after(10):
        async with (
            etcd.semaphore(lock_name, 2).acquire(ttl=5),
            etcd.rwlock(lock_name).read(ttl=5),
            etcd.lock(lock_name, ttl=5),
        ):
            names = [h.name for h in await etcd.holders()]
            assert lock_name in names
            assert not [n for n in names if n.startswith("\x00asynclock.")], names
            for other in (lock_name + "/p", lock_name + "/p/0"):
                assert await etcd.holder(other) is None


async def test_a_session_revoked_at_the_server_loses_its_permits_at_once(
    etcd_cluster: EtcdCluster, lock_name: str
) -> None:
    async with asynclock.connect(etcd_cluster.url) as backend:
        driver = etcd_driver(backend)
        sem = backend.semaphore(lock_name, 2)
        with pytest.raises(asynclock.LeaseLost, match="etcd lease") as info:
            async with sem.acquire(ttl=6.0) as permit:
                session = driver.sessions[6.0]
                await etcdctl(etcd_cluster, "lease", "revoke", f"{session.lease_id:x}")
                revoked_at = time.monotonic()
                with anyio.fail_after(5):
                    await permit.lost
        assert time.monotonic() - revoked_at < 6.0 * backend.heartbeat + 0.5
        assert info.value.token == permit.token
        with anyio.fail_after(10):
            async with sem.acquire(ttl=6.0, blocking=False) as after:
                assert after.slot == permit.slot and after.token > permit.token


async def test_another_limit_never_creates_a_permit(
    etcd: asynclock.Backend, lock_name: str
) -> None:
    """A limit-3 grant while a limit-2 permit is live answers OtherLimit in its txn: it
    never creates a permit key, even on a slot that is free; once no permit is live, the
    new limit replaces the old one atomically with its first permit."""
    two = etcd.semaphore(lock_name, 2)._store
    three = etcd.semaphore(lock_name, 3)._store
    first = await two.grant("owner-a", 5)
    second = await two.grant("owner-b", 5)
    assert isinstance(first, Granted) and isinstance(second, Granted)
    assert await two.release_permit("owner-a", first.slot, first.token)
    assert await three.grant("owner-c", 5) == OtherLimit(2)
    base = permits_prefix("", lock_name)
    reply = await etcd_driver(etcd).client.range(
        pb.RangeRequest(key=base, range_end=prefix_end(base), keys_only=True)
    )
    assert [kv.key for kv in reply.kvs] == [base + b"%d" % second.slot]
    assert await two.release_permit("owner-b", second.slot, second.token)
    third = await three.grant("owner-c", 5)
    assert isinstance(third, Granted) and third.token > second.token
    assert await two.grant("owner-d", 5) == OtherLimit(3)
    assert await three.release_permit("owner-c", third.slot, third.token)


async def test_permit_keys_as_etcdctl_shows_them(
    etcd_cluster: EtcdCluster, etcd: asynclock.Backend, lock_name: str
) -> None:
    """One key per live permit, its value the owner, its create revision the token;
    released: gone."""
    sem = etcd.semaphore(lock_name, 3)
    base = permits_prefix("", lock_name)
    with anyio.fail_after(10):
        async with sem.acquire(ttl=5) as a, sem.acquire(ttl=5) as b:
            reply = await etcd_driver(etcd).client.range(
                pb.RangeRequest(key=base, range_end=prefix_end(base))
            )
            seen = {(kv.key, kv.create_revision, bytes(kv.value)) for kv in reply.kvs}
            assert seen == {
                (base + b"%d" % p.slot, p.token, p.lease.owner.encode()) for p in (a, b)
            }
            assert a.token != b.token
    reply = await etcd_driver(etcd).client.range(
        pb.RangeRequest(key=base, range_end=prefix_end(base), keys_only=True)
    )
    assert not reply.kvs  # released: no permit key is left


async def test_many_permits_renew_in_one_call(etcd: asynclock.Backend, lock_name: str) -> None:
    """1,000 permits of one semaphore held here: each renewal round is one extend call for
    them all (one keep-alive and one key listing per session), and none is lost."""
    n = 1000
    sem = etcd.semaphore(lock_name, n)
    driver = etcd_driver(etcd)
    calls = 0
    renew = driver.leased.renew

    async def counting(refs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await renew(refs)

    driver.leased.renew = counting  # type: ignore[method-assign]
    held = 0
    all_held, done = anyio.Event(), anyio.Event()

    async def hold() -> None:
        nonlocal held
        async with sem.acquire(ttl=5.0, timeout=60) as permit:
            held += 1
            if held == n:
                all_held.set()
            await done.wait()
            assert not permit.lost

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(hold)
            await all_held.wait()
            calls = 0
            for _ in range(3):
                await asynclock.testing.next_renewal_round(etcd)
            rounds_calls = calls
            done.set()
    print(f"\netcd: {n} permits held, {rounds_calls} extend calls over 3 renewal rounds")
    assert rounds_calls <= 3 * 2  # one per round (a round may straddle the count)


async def test_names_nested_by_slash_are_separate(etcd: asynclock.Backend, lock_name: str) -> None:
    """A read-write lock ``x/r`` (whose epoch key is kept for ever) and a semaphore ``x/p``
    live beside ``x``'s ranges, not inside them: before the name was escaped, once ``x/r``
    had had a writer, every write on ``x`` was refused as if readers held it."""
    with anyio.fail_after(10):
        async with etcd.rwlock(lock_name + "/r").write(ttl=5):
            pass
        async with etcd.rwlock(lock_name + "/i").read(ttl=5):
            async with etcd.rwlock(lock_name).write(ttl=5, blocking=False) as w:
                assert w.token > 0
        async with etcd.semaphore(lock_name + "/p", 1).acquire(ttl=5):
            async with etcd.semaphore(lock_name, 1).acquire(ttl=5, blocking=False) as permit:
                assert permit.slot == 0
            assert [h.slot for h in await etcd.semaphore(lock_name, 1).holders()] == []


async def test_a_place_is_a_key_on_its_own_lease_kept_by_a_keep_alive(
    etcd: asynclock.Backend, lock_name: str
) -> None:
    """A queued waiter's place is ``q/<owner>`` on a lease of its own of ceil(place_ttl)
    seconds; each later poll is one txn and one keep-alive (no put: the key's create
    revision, its position, never changes); a withdrawal deletes it at once."""
    driver = etcd_driver(etcd)
    client = driver.client
    holder = etcd.semaphore(lock_name, 1)._store
    waiter = etcd.semaphore(lock_name, 1)._store
    later = etcd.semaphore(lock_name, 1)._store
    queue = semaphore_prefix("", lock_name) + b"q/"

    async def places() -> list[tuple[bytes, int, int]]:
        reply = await client.range(pb.RangeRequest(key=queue, range_end=prefix_end(queue)))
        found = [(kv.key[len(queue) :], kv.create_revision, kv.lease) for kv in reply.kvs]
        return sorted(found, key=lambda p: p[1])  # in arrival order

    with anyio.fail_after(10):
        held = await holder.grant("holder", 5)
        assert isinstance(held, Granted)
        assert isinstance(await waiter.grant("waiter", 1.0, queue=True), Full)
        [(owner, position, lease)] = await places()
        assert owner == b"waiter"
        assert lease not in {s.lease_id for s in driver.sessions.values()}
        granted = (await client.time_to_live(lease, keys=False)).grantedTTL
        assert granted == math.ceil(place_ttl(1.0))

        calls: dict[str, int] = {}
        for method in ("txn", "range", "keep_alive", "grant", "revoke", "time_to_live"):
            real = getattr(client, method)

            def counted(*args: Any, _real: Any = real, _m: str = method, **kw: Any) -> Any:
                calls[_m] = calls.get(_m, 0) + 1
                return _real(*args, **kw)

            setattr(client, method, counted)
        try:
            assert isinstance(await waiter.grant("waiter", 1.0, queue=True), Full)
        finally:
            for method in list(vars(client)):
                if method in calls:
                    delattr(client, method)
        assert calls == {"txn": 1, "keep_alive": 1}
        assert await places() == [(b"waiter", position, lease)]

        assert isinstance(await later.grant("later", 1.0, queue=True), Full)
        assert [p[0] for p in await places()] == [b"waiter", b"later"]
        await waiter.withdraw("waiter")
        assert [p[0] for p in await places()] == [b"later"]
        assert await holder.release_permit("holder", held.slot, held.token)
        assert isinstance(await later.grant("later", 1.0, queue=True), Granted)
        assert await places() == []


@pytest.mark.parametrize("arrival", ["place", "permit"])
async def test_an_arrival_between_the_read_and_the_grant_is_not_overtaken(
    etcd: asynclock.Backend, lock_name: str, arrival: str
) -> None:
    """Limit 3, one permit live, one waiter queued: an asker without a place reads that it
    may take a permit (1 live + 1 ahead < 3). A place taken, or a permit granted, between
    that read and its grant txn would make the count stale: the txn's compares refuse it,
    and the asker answers Full on its next read (without the arrival it is granted)."""
    driver = etcd_driver(etcd)
    client = driver.client
    stores = [etcd.semaphore(lock_name, 3)._store for _ in range(5)]
    first, second, third, waiter, asker = stores
    base = semaphore_prefix("", lock_name)
    intruder = base + (b"q/intruder" if arrival == "place" else b"p/2")

    with anyio.fail_after(10):
        held = [await s.grant(f"h{i}", 5) for i, s in enumerate((first, second, third))]
        assert all(isinstance(h, Granted) for h in held)
        assert isinstance(await waiter.grant("waiter", 5, queue=True), Full)
        for i, (s, h) in enumerate(zip((second, third), held[1:], strict=True), start=1):
            assert isinstance(h, Granted)
            assert await s.release_permit(f"h{i}", h.slot, h.token)

        real = driver.leased.txn
        arrived = False

        async def arrive_after_the_read(session: Any, request: Any) -> Any:
            nonlocal arrived
            reply = await real(session, request)
            if not arrived and reply is not None and not reply.succeeded:
                arrived = True
                put = pb.PutRequest(key=intruder, value=b"intruder")
                await client.txn(pb.TxnRequest(success=[pb.RequestOp(request_put=put)]))
            return reply

        driver.leased.txn = arrive_after_the_read  # type: ignore[method-assign]
        try:
            assert isinstance(await asker.grant("asker", 5), Full)
        finally:
            del driver.leased.txn
        assert arrived
        await client.delete(intruder)
        granted = await asker.grant("asker", 5)
        assert isinstance(granted, Granted)
        assert await asker.release_permit("asker", granted.slot, granted.token)
        assert isinstance(await waiter.grant("waiter", 5, queue=True), Granted)
