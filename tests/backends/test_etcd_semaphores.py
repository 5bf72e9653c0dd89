"""Semaphores and read-write locks on etcd (issue 42): what the conformance suite cannot
see — the key layout apart from locks, a session revoked at the server, the limit race,
renewal of many permits in one call, and the keys etcdctl shows."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import pytest

import asynclock
import asynclock.testing
from asynclock._core.permit_store import Granted, OtherLimit
from asynclock.backends.etcd import EtcdDriver
from asynclock.backends.etcd import _proto as pb
from asynclock.backends.etcd._sem import permits_prefix
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
