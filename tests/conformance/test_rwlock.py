"""Read-write locks (issue 42 part 2): ``backend.rwlock(name)`` on every backend with the
``rwlock`` capability; NotImplementedError, saying so, elsewhere."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing
from asynclock._core.rw_store import READ, WRITE, WRITER_WAITS, Held
from tests.support.spec import BackendSpec, specs_split_by

pytestmark = pytest.mark.anyio


# The backends with rwlocks (spec) and the others (other_spec).
spec, other_spec = specs_split_by("rwlock")


async def other_backend(spec: BackendSpec, backend: asynclock.Backend) -> tuple[Any, Any]:
    """A second backend on the same server (the same one for memory://): (cm, backend)."""
    if spec.id == "memory":
        return None, backend
    cm = spec.connect()
    return cm, await cm.__aenter__()


async def until_writer_waits(rw: asynclock.RWLock) -> None:
    """Return once a new reader is refused because a writer waits (its intent is in)."""
    while True:
        try:
            async with rw.read(ttl=5, blocking=False):
                pass
        except asynclock.LockHeld as exc:
            if WRITER_WAITS in str(exc):
                return
        await anyio.sleep(0.01)


# -- sharing, exclusion and epochs -------------------------------------------------------------


async def test_readers_share_one_epoch_and_see_each_write(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    rw = backend.rwlock(lock_name)
    readers = 4
    tokens: list[int] = []
    all_in = anyio.Event()

    async def reader() -> None:
        async with rw.read(ttl=10, timeout=10) as r:
            assert r.mode == "read" and r.name == lock_name
            tokens.append(r.token)
            if len(tokens) == readers:
                all_in.set()
            await all_in.wait()  # every reader holds at the same time

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            for _ in range(readers):
                tg.start_soon(reader)
        assert len(set(tokens)) == 1
        async with rw.write(ttl=10) as w:
            assert w.mode == "write" and w.token > tokens[0]
        async with rw.read(ttl=10) as a, rw.read(ttl=10) as b:
            assert a.token == b.token == w.token  # readers after a write see its epoch
        async with rw.write(ttl=10) as w2:
            assert w2.token > w.token


async def test_a_writer_excludes_readers_and_writers(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """A probe: never a reader and a writer at once, never two writers; writer epochs
    strictly increase in grant order; every reader holds the last writer's epoch."""
    rw = backend.rwlock(lock_name)
    async with rw.write(ttl=10) as first:
        epochs = [first.token]
    live = {"r": 0, "w": 0}
    most_readers = 0

    async def worker(i: int) -> None:
        nonlocal most_readers
        for n in range(4):
            if (i + n) % 3 == 0:
                async with rw.write(ttl=10, timeout=20) as w:
                    assert live == {"r": 0, "w": 0}, live
                    live["w"] += 1
                    assert w.token > epochs[-1]
                    epochs.append(w.token)
                    for _ in range(3):
                        await anyio.lowlevel.checkpoint()
                    live["w"] -= 1
            else:
                async with rw.read(ttl=10, timeout=20) as r:
                    assert live["w"] == 0, live
                    live["r"] += 1
                    most_readers = max(most_readers, live["r"])
                    assert r.token == epochs[-1]
                    for _ in range(3):
                        await anyio.lowlevel.checkpoint()
                    live["r"] -= 1

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(worker, i)
    assert len(epochs) == 1 + 8 and epochs == sorted(set(epochs))


async def test_a_waiting_writer_refuses_new_readers(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    rw = backend.rwlock(lock_name)
    written = anyio.Event()
    with anyio.fail_after(10):
        async with rw.read(ttl=10) as r, anyio.create_task_group() as tg:

            async def writer() -> None:
                async with rw.write(ttl=10, timeout=8) as w:
                    assert w.token > r.token
                written.set()

            tg.start_soon(writer)
            await until_writer_waits(rw)  # a reader already in stays; new ones wait
            assert not r.lost
            await r.release()
            await written.wait()


async def test_a_waiting_writer_blocks_new_readers(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """Writer preference: readers overlap without a gap, yet a writer gets in within a
    bounded time (their holds end, no new one begins while it waits)."""
    rw = backend.rwlock(lock_name)
    stop, overlapping = anyio.Event(), anyio.Event()
    reads_during = 0
    writing = False

    async def reader() -> None:
        nonlocal reads_during
        while not stop.is_set():
            async with rw.read(ttl=10, timeout=10):
                assert not writing
                reads_during += 1
                if reads_during >= 6:  # the readers overlap continuously
                    overlapping.set()
                await anyio.sleep(0.05)

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(reader)
            await overlapping.wait()
            started = time.monotonic()
            async with rw.write(ttl=10, timeout=5) as w:
                waited = time.monotonic() - started
                writing = True
                with pytest.raises(asynclock.LockHeld, match="a writer holds it"):
                    async with rw.read(ttl=5, blocking=False):
                        pytest.fail("a reader beside a writer")
                writing = False
            stop.set()
    assert w.token > 0 and waited < 3.0


async def test_busy_timeout_and_release_owner_checked(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    rw = backend.rwlock(lock_name)
    with anyio.fail_after(20):
        async with rw.read(ttl=10):
            with pytest.raises(asynclock.LockHeld, match="readers hold it"):
                async with rw.write(ttl=10, blocking=False):
                    pytest.fail("a writer beside a reader")
            started = time.monotonic()
            with pytest.raises(asynclock.AcquireTimeout):
                async with rw.write(ttl=10, timeout=0.3):
                    pytest.fail("a writer beside a reader")
            assert 0.3 <= time.monotonic() - started < 3.0
            # The writer that timed out withdrew its intent: readers still get in.
            async with rw.read(ttl=10, blocking=False):
                pass
        async with rw.write(ttl=10) as first:
            with pytest.raises(asynclock.LockHeld, match="a writer holds it"):
                async with rw.write(ttl=10, blocking=False):
                    pytest.fail("two writers")
            with pytest.raises(asynclock.AcquireTimeout):
                async with rw.read(ttl=10, timeout=0.2):
                    pytest.fail("a reader beside a writer")
            assert await first.release() is True
            assert await first.release() is False  # idempotent
            async with rw.write(ttl=10, blocking=False) as second:
                assert second.token > first.token
                # The first writer's late releases never free the second's hold.
                assert await first.release() is False
                store = rw._store
                assert await store.release_hold(WRITE, first.lease.owner, first.token) is False
                assert await store.release_hold(WRITE, first.lease.owner, None) is False
                assert await store.release_hold(READ, second.lease.owner, None) is False
                with pytest.raises(asynclock.LockHeld):
                    async with rw.write(ttl=10, blocking=False):
                        pytest.fail("a stale release freed someone else's hold")
        async with rw.read(ttl=10) as r:
            assert await r.release() is True and await r.release() is False
        async with rw.write(ttl=10, blocking=False):  # every hold was given back
            pass


# -- loss -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_force_loss_cancels_the_body(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str, mode: str
) -> None:
    rw = backend.rwlock(lock_name)
    entered = anyio.Event()
    reached_end = False
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def holder() -> None:
                nonlocal reached_end
                with pytest.raises(asynclock.LeaseLost) as info:
                    async with getattr(rw, mode)(ttl=10) as hold:
                        assert asynclock.current_lease() is hold.lease
                        entered.set()
                        await anyio.sleep_forever()
                        reached_end = True  # pragma: no cover
                assert info.value.token == hold.token
                assert hold.lost

            tg.start_soon(holder)
            await entered.wait()
            (lease,) = [le for le in backend.held() if le.name == rw.lease_name]
            asynclock.testing.force_loss(lease)
    assert not reached_end
    assert backend.stats().losses >= 1


@pytest.mark.parametrize("mode", ["read", "write"])
async def test_a_hold_lost_before_its_body_never_runs(
    spec: BackendSpec, lock_name: str, mode: str
) -> None:
    """Past its local deadline before the body begins (a frozen process): LeaseLost at
    the ``async with``, and the body never starts; the hold is given back."""
    clock = asynclock.testing.ManualClock(1000.0)
    async with spec.connect(clock=clock) as backend:
        rw = backend.rwlock(lock_name)
        grant = rw._store.grant

        async def freeze_after_grant(m: str, owner: str, ttl: float, *, intend: bool) -> Any:
            answer = await grant(m, owner, ttl, intend=intend)
            clock.advance(ttl + 1)  # the process "froze" between the grant and the body
            return answer

        rw._store.grant = freeze_after_grant  # type: ignore[method-assign,assignment]
        with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost):
            async with getattr(rw, mode)(ttl=5):
                pytest.fail("the body of a lost hold ran")
        rw._store.grant = grant  # type: ignore[method-assign]
        with anyio.fail_after(10):
            async with rw.write(ttl=5, blocking=False):  # given back
                pass


@pytest.mark.parametrize("mode", [READ, WRITE])
async def test_a_dead_holder_is_freed_after_its_ttl(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str, mode: str
) -> None:
    """A hold granted and then never renewed (its process died): a writer of another
    backend gets in once its ttl has run out, with a larger epoch."""
    ghost = await backend.rwlock(lock_name)._store.grant(mode, "ghost-owner", 0.5, intend=False)
    assert isinstance(ghost, int)
    cm, other = await other_backend(spec, backend)
    try:
        rw = other.rwlock(lock_name)
        with pytest.raises(asynclock.LockHeld):
            async with rw.write(ttl=5, blocking=False):
                pytest.fail("granted over a live hold")
        started = time.monotonic()
        with anyio.fail_after(10):
            async with rw.write(ttl=5, timeout=8) as w:
                waited = time.monotonic() - started
                assert w.token > ghost
        assert waited < 0.5 + 1.5  # the bounded backoff: at most 0.5 s past the expiry
    finally:
        if cm is not None:
            await cm.__aexit__(None, None, None)


async def test_a_dead_waiting_writers_intent_expires(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """A writer that recorded its intent and died (stopped renewing it by waiting) keeps
    new readers out only until its intent's ttl has run out."""
    rw = backend.rwlock(lock_name)
    with anyio.fail_after(10):
        async with rw.read(ttl=10):
            dead = await rw._store.grant(WRITE, "ghost-writer", 0.5, intend=True)
            assert isinstance(dead, Held)
        cm, other = await other_backend(spec, backend)
        try:
            rw2 = other.rwlock(lock_name)
            with pytest.raises(asynclock.LockHeld, match="a writer is waiting"):
                async with rw2.read(ttl=5, blocking=False):
                    pytest.fail("a reader went ahead of a waiting writer")
            started = time.monotonic()
            async with rw2.read(ttl=5, timeout=8):
                waited = time.monotonic() - started
        finally:
            if cm is not None:
                await cm.__aexit__(None, None, None)
    assert waited < 0.5 + 1.5


# -- bad input and other backends -------------------------------------------------------------


async def test_bad_names_and_arguments() -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(ValueError):
            backend.rwlock("")
        with pytest.raises(TypeError):
            backend.rwlock(b"x")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            backend.rwlock(None)  # type: ignore[arg-type]
        rw = backend.rwlock("x")
        with pytest.raises(ValueError):
            rw.read(ttl=-1)
        with pytest.raises(ValueError):
            rw.write(ttl=0)
        with pytest.raises(TypeError):
            rw.write(ttl=5, blocking="no")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            rw.read(ttl=5, timeout=-1)
        with pytest.raises(TypeError):
            rw.read(5)  # type: ignore[call-arg]
        hold = rw.read(ttl=5)
        async with hold:
            pass
        with pytest.raises(RuntimeError, match="entered once"):
            async with hold:
                pass


async def test_the_namespace_is_apart_from_locks_and_semaphores(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(10):
        async with backend.rwlock(lock_name).write(ttl=10) as w:
            assert w.lease.name == "rwlock:" + lock_name
            async with backend.lock(lock_name, ttl=10, blocking=False):
                pass
            if spec.can("semaphore"):
                async with backend.semaphore(lock_name, 1).acquire(ttl=10, blocking=False):
                    pass


async def test_not_on_this_backend(other_spec: BackendSpec) -> None:
    backend = other_spec.connect()  # no I/O: the check is made when the rwlock is made
    with pytest.raises(NotImplementedError, match=r"read-write locks are not on .* yet.*sqlite://"):
        backend.rwlock("jobs")


@pytest.mark.parametrize(
    "url",
    [
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
    ],
)
async def test_not_implemented_without_a_server(url: str) -> None:
    backend = asynclock.connect(url)
    with pytest.raises(NotImplementedError, match=r"read-write locks are not on .* yet.*redis://"):
        backend.rwlock("jobs")


# -- documented defaults on fresh servers ------------------------------------------------------


async def _defaults(backend: asynclock.Backend) -> tuple[int, int]:
    rw = backend.rwlock("catalog")
    with anyio.fail_after(10):
        async with rw.read(ttl=5) as a, rw.read(ttl=5) as b:
            assert a.token == b.token
            with pytest.raises(asynclock.LockHeld):
                async with rw.write(ttl=5, blocking=False):
                    pytest.fail("a writer beside readers")
        async with rw.write(ttl=5) as w:
            assert w.token > a.token
        return a.token, w.token


async def test_documented_defaults_on_a_fresh_sqlite_file(tmp_path: Path) -> None:
    async with asynclock.connect(f"sqlite:///{tmp_path / 'fresh.db'}") as backend:
        assert await _defaults(backend) == (0, 1)


async def test_documented_defaults_on_a_freshly_started_redis(redis_factory: Any) -> None:
    server = redis_factory(fresh=True)
    async with asynclock.connect(server.url) as backend:
        read, write = await _defaults(backend)
        assert read > 0 and write == read + 1  # seeded from the server's TIME


async def test_redlock_says_why_it_has_none() -> None:
    backend = asynclock.connect("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    with pytest.raises(NotImplementedError, match="needs a grant on a majority") as info:
        backend.rwlock("jobs")
    assert "backend.rwlock() works on" in str(info.value) and "etcd://" in str(info.value)
