"""Counting semaphores (issue 42 part 1): ``backend.semaphore(name, limit)`` on every
backend with the ``semaphore`` capability; NotImplementedError, saying so, elsewhere."""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

import asynclock
import asynclock.testing
from asynclock._core.permit_store import MAX_LIMIT, Granted
from asynclock.backends.memory import MemoryDriver
from tests.support.spec import BackendSpec, specs_split_by

pytestmark = pytest.mark.anyio


# The backends with semaphores (spec) and the others (other_spec).
spec, other_spec = specs_split_by("semaphore")


async def expire_permits(spec: BackendSpec, backend: asynclock.Backend, name: str) -> None:
    """Expire every permit of ``name`` at the server behind the holders' backs."""
    if spec.id == "memory":
        assert isinstance(backend.driver, MemoryDriver)
        backend.driver.permits.pop(name, None)
    elif spec.id == "sqlite":
        conn = sqlite3.connect(urlsplit(spec.url).path[1:], isolation_level=None, timeout=5)
        try:
            conn.execute("UPDATE asynclock_permit SET expires_at = 0 WHERE name = ?", (name,))
        finally:
            conn.close()
    elif spec.id.startswith("etcd"):
        from asynclock.backends.etcd._sem import permits_prefix
        from tests.support.etcd_servers import delete_prefix

        await anyio.to_thread.run_sync(delete_prefix, spec.url, permits_prefix("", name))
    elif spec.id.startswith("zookeeper"):
        from asynclock.backends.zookeeper._paths import reserved_path
        from tests.support.zk_servers import delete_children

        permits = reserved_path("", "sem", name) + "/p"
        hosts = urlsplit(spec.url).netloc
        await anyio.to_thread.run_sync(delete_children, hosts, permits)
    elif spec.id.startswith("redis"):
        import redis.asyncio

        from asynclock.backends.redis.routed import Routed
        from asynclock.backends.redis.semaphore import semaphore_keys

        driver = backend.driver
        if isinstance(driver, Routed):  # Sentinel, Cluster: the primary the name lives on
            host, port = driver.route_now(name).address.rsplit(":", 1)
            client = redis.asyncio.Redis(host=host, port=int(port))
        else:
            client = redis.asyncio.Redis.from_url(spec.url)
        try:
            await client.delete(*semaphore_keys(name, "asynclock:"))
        finally:
            await client.aclose()
    else:
        import asyncpg  # type: ignore[import-untyped]

        conn = await asyncpg.connect(spec.url.split("?")[0])
        try:
            await conn.execute(
                "UPDATE asynclock_permit SET expires_at = 'epoch' WHERE name = $1",
                name.encode(),
            )
        finally:
            await conn.close()


# -- the limit, slots and tokens ---------------------------------------------------------------


async def test_limit_slots_and_tokens_under_contention(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    limit, tasks, rounds = 3, 10, 3
    sem = backend.semaphore(lock_name, limit)
    live: dict[int, int] = {}  # slot -> token of the live permit in it
    most = 0
    tokens: dict[int, list[int]] = defaultdict(list)
    full = anyio.Event()

    async def worker() -> None:
        nonlocal most
        for _ in range(rounds):
            async with sem.acquire(ttl=10, timeout=30) as permit:
                assert 0 <= permit.slot < limit
                assert permit.slot not in live, "two live permits share a slot"
                live[permit.slot] = permit.token
                tokens[permit.slot].append(permit.token)
                most = max(most, len(live))
                assert len(live) <= limit
                if len(live) == limit:
                    full.set()
                # The first holders stay until the limit is reached (the probe must see
                # it reached, not only never passed); later ones yield a little.
                await full.wait()
                for _ in range(3):
                    await anyio.lowlevel.checkpoint()
                del live[permit.slot]

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
    assert most == limit  # the probe saw the limit reached, never passed
    assert sum(len(t) for t in tokens.values()) == tasks * rounds
    for slot, seen in tokens.items():
        assert seen == sorted(seen) and len(set(seen)) == len(seen), (slot, seen)


async def test_busy_timeout_and_release_owner_checked(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    sem = backend.semaphore(lock_name, 1)
    with anyio.fail_after(20):
        async with sem.acquire(ttl=10) as first:
            assert (first.slot, first.name, first.limit) == (0, lock_name, 1)
            with pytest.raises(asynclock.LockHeld, match="all 1 permits"):
                async with sem.acquire(ttl=10, blocking=False):
                    pytest.fail("granted past the limit")
            started = time.monotonic()
            with pytest.raises(asynclock.AcquireTimeout):
                async with sem.acquire(ttl=10, timeout=0.3):
                    pytest.fail("granted past the limit")
            assert 0.3 <= time.monotonic() - started < 3.0
            assert await first.release() is True
            assert await first.release() is False  # idempotent
            async with sem.acquire(ttl=10, blocking=False) as second:
                assert second.slot == 0 and second.token > first.token
                # The first holder's late releases never free the second's permit.
                assert await first.release() is False
                store = sem._store
                assert await store.release_permit(first.lease.owner, 0, first.token) is False
                assert await store.release_permit(first.lease.owner, None, None) is False
                with pytest.raises(asynclock.LockHeld):
                    async with sem.acquire(ttl=10, blocking=False):
                        pytest.fail("a stale release freed someone else's permit")
        # Released on exit: free again.
        async with sem.acquire(ttl=10, blocking=False) as third:
            assert third.token > first.token


async def test_permits_are_renewed(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """Held for several ttls: renewed with the session's leases, never lost."""
    sem = backend.semaphore(lock_name, 2)
    with anyio.fail_after(20):
        async with sem.acquire(ttl=0.6) as a, sem.acquire(ttl=0.6) as b:
            before = backend.stats().renewals
            end = time.monotonic() + 1.3  # over two ttls
            while time.monotonic() < end:
                await asynclock.testing.next_renewal_round(backend)
            assert not a.lost and not b.lost
            assert backend.stats().renewals >= before + 4
            assert {p.lease for p in (a, b)} <= set(backend.held())
            with pytest.raises(asynclock.LockHeld):
                async with sem.acquire(ttl=5, blocking=False):
                    pytest.fail("granted past the limit")


# -- loss -------------------------------------------------------------------------------------


async def test_force_loss_cancels_the_body(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    sem = backend.semaphore(lock_name, 2)
    entered = anyio.Event()
    reached_end = False
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def holder() -> None:
                nonlocal reached_end
                with pytest.raises(asynclock.LeaseLost) as info:
                    async with sem.acquire(ttl=10) as permit:
                        assert asynclock.current_lease() is permit.lease
                        entered.set()
                        await anyio.sleep_forever()
                        reached_end = True  # pragma: no cover
                assert info.value.token == permit.token
                assert permit.lost

            tg.start_soon(holder)
            await entered.wait()
            (lease,) = [le for le in backend.held() if le.name == sem.lease_name]
            asynclock.testing.force_loss(lease)
    assert not reached_end
    assert backend.stats().losses >= 1


async def test_expired_at_the_server_cancels_the_body(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    sem = backend.semaphore(lock_name, 1)
    entered = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def holder() -> None:
                with pytest.raises(asynclock.LeaseLost):
                    async with sem.acquire(ttl=0.6):
                        entered.set()
                        await anyio.sleep_forever()

            tg.start_soon(holder)
            await entered.wait()
            await expire_permits(spec, backend, lock_name)
        # The name is free at the server (expired), so a new permit comes at once.
        async with sem.acquire(ttl=5, blocking=False) as again:
            assert again.slot == 0


async def test_a_permit_lost_before_its_body_never_runs(spec: BackendSpec, lock_name: str) -> None:
    """Past its local deadline before the body begins (a frozen process): LeaseLost at
    the ``async with``, and the body never starts."""
    clock = asynclock.testing.ManualClock(1000.0)
    async with spec.connect(clock=clock) as backend:
        sem = backend.semaphore(lock_name, 1)
        grant = sem._store.grant

        async def freeze_after_grant(owner: str, ttl: float, *, queue: bool = False) -> Any:
            answer = await grant(owner, ttl, queue=queue)
            clock.advance(ttl + 1)  # the process "froze" between the grant and the body
            return answer

        sem._store.grant = freeze_after_grant  # type: ignore[method-assign]
        with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost):
            async with sem.acquire(ttl=5):
                pytest.fail("the body of a lost permit ran")
        sem._store.grant = grant  # type: ignore[method-assign]
        with anyio.fail_after(10):
            async with sem.acquire(ttl=5, blocking=False) as permit:  # given back
                assert permit.slot == 0


async def test_a_dead_holders_permit_is_free_after_its_ttl(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """A permit granted and then never renewed (its process died): taken by another
    backend once its ttl has run out, with a larger token for the slot."""
    dead = backend.semaphore(lock_name, 1)._store
    ghost = await dead.grant("ghost-owner", 0.8)
    assert isinstance(ghost, Granted)
    if spec.id == "memory":
        other_cm: Any = None
        other = backend
    else:
        other_cm = spec.connect()
        other = await other_cm.__aenter__()
    try:
        sem = other.semaphore(lock_name, 1)
        with pytest.raises(asynclock.LockHeld):
            async with sem.acquire(ttl=5, blocking=False):
                pytest.fail("granted over a live permit")
        started = time.monotonic()
        with anyio.fail_after(10):
            async with sem.acquire(ttl=5, timeout=8) as permit:
                waited = time.monotonic() - started
                assert permit.slot == ghost.slot and permit.token > ghost.token
        assert waited < 0.8 + 1.5  # the bounded backoff: at most 0.5 s past the expiry
    finally:
        if other_cm is not None:
            await other_cm.__aexit__(None, None, None)


# -- bad input and other backends -------------------------------------------------------------

BAD_LIMITS: list[tuple[Any, type[Exception], str]] = [
    (0, ValueError, "limit must be from 1 to 10000 permits, got 0"),
    (-1, ValueError, "got -1"),
    (MAX_LIMIT + 1, ValueError, "got 10001"),
    (2.0, TypeError, "limit must be an int from 1 to 10000.*not float"),
    ("3", TypeError, "not str"),
    (True, TypeError, "not bool"),
    (None, TypeError, "not NoneType"),
]


@pytest.mark.parametrize(("limit", "error", "words"), BAD_LIMITS)
async def test_bad_limits(limit: Any, error: type[Exception], words: str) -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(error, match=words):
            backend.semaphore("jobs", limit)


async def test_bad_names_and_arguments() -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(ValueError):
            backend.semaphore("", 2)
        with pytest.raises(TypeError):
            backend.semaphore(b"x", 2)  # type: ignore[arg-type]
        sem = backend.semaphore("x", 2)
        with pytest.raises(ValueError):
            sem.acquire(ttl=-1)
        with pytest.raises(TypeError):
            sem.acquire(ttl=5, blocking="no")  # type: ignore[arg-type]


async def test_limit_mismatch_and_the_namespace(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(10):
        async with backend.semaphore(lock_name, 2).acquire(ttl=10):
            with pytest.raises(asynclock.SemaphoreLimitMismatch) as info:
                async with backend.semaphore(lock_name, 3).acquire(ttl=10):
                    pytest.fail("granted under another limit")
            assert isinstance(info.value, ValueError)
            assert "limit=3" in str(info.value) and "limit=2" in str(info.value)
            # A lock of the same name is another namespace: independent of the semaphore.
            async with backend.lock(lock_name, ttl=10, blocking=False):
                pass
        # Every permit released: the new limit takes effect.
        async with backend.semaphore(lock_name, 3).acquire(ttl=10, blocking=False) as p:
            assert p.limit == 3


async def test_not_on_this_backend(other_spec: BackendSpec) -> None:
    backend = other_spec.connect()  # no I/O: the check is made when the semaphore is made
    with pytest.raises(NotImplementedError, match=r"semaphores are not on .* yet.*sqlite://"):
        backend.semaphore("jobs", 2)


@pytest.mark.parametrize(
    "url",
    [
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
    ],
)
async def test_not_implemented_without_a_server(url: str) -> None:
    backend = asynclock.connect(url)
    with pytest.raises(NotImplementedError, match=r"semaphores are not on .* yet.*redis://"):
        backend.semaphore("jobs", 2)


# -- documented defaults on fresh servers ------------------------------------------------------


async def test_documented_defaults_on_a_fresh_sqlite_file(tmp_path: Path) -> None:
    async with asynclock.connect(f"sqlite:///{tmp_path / 'fresh.db'}") as backend:
        sem = backend.semaphore("gpu", 2)
        with anyio.fail_after(10):
            async with sem.acquire(ttl=5) as a, sem.acquire(ttl=5) as b:
                assert {a.slot, b.slot} == {0, 1} and a.token == b.token == 1
                with pytest.raises(asynclock.LockHeld):
                    async with sem.acquire(ttl=5, blocking=False):
                        pytest.fail("granted past the limit")


async def test_documented_defaults_on_a_freshly_started_redis(redis_factory: Any) -> None:
    server = redis_factory(fresh=True)
    async with asynclock.connect(server.url) as backend:
        sem = backend.semaphore("gpu", 2)
        with anyio.fail_after(10):
            async with sem.acquire(ttl=5) as a, sem.acquire(ttl=5) as b:
                assert {a.slot, b.slot} == {0, 1} and a.token > 0 and b.token > 0
                with pytest.raises(asynclock.LockHeld):
                    async with sem.acquire(ttl=5, blocking=False):
                        pytest.fail("granted past the limit")


async def test_redlock_says_why_it_has_none() -> None:
    backend = asynclock.connect("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    with pytest.raises(NotImplementedError, match="need not agree on one slot") as info:
        backend.semaphore("jobs", 2)
    assert "one Redlock per slot" in str(info.value) and "etcd://" in str(info.value)
