"""G3/G4/G5/G7: a lost lease cancels the holder and is loud; stale holders can't write."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import asynclock
import asynclock.testing
from asynclock.backends import LeaseRef, Refused
from tests.support.procs import start_worker
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


async def test_gc_pause_sigstop_holder_is_cancelled_and_fenced(
    shared_spec: BackendSpec, lock_name: str, tmp_path: Path, loop: str = "asyncio"
) -> None:
    """The failure fencing exists for, with real processes: freeze the holder past its ttl.
    ``loop``: the holder process's event loop (tests/test_uvloop.py passes "uvloop")."""
    fence_db = str(tmp_path / "resource.db")
    ttl = 0.6
    holder = await start_worker(
        shared_spec, mode="hold", name=lock_name, ttl=ttl, fence_db=fence_db, loop=loop
    )
    first = await holder.expect("acquired")
    holder.signal(signal.SIGSTOP)
    try:
        async with shared_spec.connect() as backend:
            # Succeeds only once the frozen holder's lease has expired on the server.
            async with backend.lock(lock_name, ttl=5.0, timeout=15) as lease:
                assert lease.token > first["token"]
                from tests.support.worker import fenced_write

                assert fenced_write(fence_db, lock_name, lease.token, "successor") == "accepted"
                resumed_at = time.monotonic()
                holder.signal(signal.SIGCONT)
                lost = await holder.expect("lost")
                late = await holder.expect("late_write")
    finally:
        holder.signal(signal.SIGCONT)
    assert lost["token"] == first["token"]
    assert lost["reason"]  # says why: deadline passed or renewal refused
    assert lost["at"] - resumed_at < 2.0, "holder was not cancelled promptly after waking"
    assert late["result"] == "stale"
    assert await holder.wait() == 0
    rows = sqlite3.connect(fence_db).execute("SELECT writer, token FROM ledger").fetchall()
    assert rows == [("holder-before-pause", first["token"]), ("successor", lease.token)]


async def test_blocked_event_loop_past_ttl_cancels_holder(
    backend: asynclock.Backend, lock_name: str
) -> None:
    """A pause inside the holder's own process (blocked loop) is caught by the deadline."""
    reached_after_pause = False
    with pytest.raises(asynclock.LeaseLost) as info:
        async with backend.lock(lock_name, ttl=0.3) as lease:
            time.sleep(0.4)  # noqa: ASYNC251 - the simulated GC pause: nothing runs, not even the renewer
            with pytest.raises(asynclock.LeaseLost):
                lease.check()
            await anyio.lowlevel.checkpoint()
            reached_after_pause = True  # pragma: no cover - must be cancelled first
    assert not reached_after_pause
    assert info.value.token == lease.token
    assert info.value.reason
    assert lease.lost


async def test_refused_renewal_cancels_within_one_heartbeat(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    ttl = 0.9
    cancelled_at = 0.0
    stolen_at = 0.0
    with pytest.raises(asynclock.LeaseLost) as info:
        async with backend.lock(lock_name, ttl=ttl) as lease:
            try:
                stolen_at = time.monotonic()
                await spec.sabotage(backend, lock_name)
                await anyio.sleep_forever()
            finally:
                cancelled_at = time.monotonic()
    assert "refused" in info.value.reason or "deadline" in info.value.reason
    interval = ttl * backend.heartbeat
    assert cancelled_at - stolen_at <= interval + 0.25
    assert backend.stats().losses >= 1
    assert await lease.release() is False  # release after loss: reported no-op
    assert not await backend.validate(lock_name, lease.token)


async def test_work_in_child_tasks_is_cancelled_on_loss(
    backend: asynclock.Backend, lock_name: str
) -> None:
    children_cancelled = 0
    started = anyio.Event()

    async def child() -> None:
        nonlocal children_cancelled
        try:
            started.set()
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            children_cancelled += 1
            raise

    with pytest.raises(asynclock.LeaseLost):
        async with backend.lock(lock_name, ttl=5.0) as lease:
            async with anyio.create_task_group() as tg:
                tg.start_soon(child)
                tg.start_soon(child)
                await started.wait()
                asynclock.testing.force_loss(lease, "test")
    assert children_cancelled == 2


async def test_lost_signal_is_awaitable(backend: asynclock.Backend, lock_name: str) -> None:
    lease = await backend.acquire(lock_name, ttl=5.0)
    assert not lease.lost
    async with anyio.create_task_group() as tg:

        async def lose() -> None:
            asynclock.testing.force_loss(lease, "because")

        tg.start_soon(lose)
        assert await lease.lost == "because"
    assert lease.remaining() == 0
    assert await lease.release() is False


async def test_non_owner_cannot_extend_or_release(
    backend: asynclock.Backend, lock_name: str
) -> None:
    driver = backend.driver
    async with backend.lock(lock_name, ttl=5.0) as lease:
        stranger = "0" * 32
        [result] = await driver.extend([LeaseRef(lock_name, stranger, lease.token, 5.0)])
        assert isinstance(result, Refused)
        [result] = await driver.extend([LeaseRef(lock_name, lease.owner, lease.token + 1, 5.0)])
        assert isinstance(result, Refused)
        assert await driver.release(lock_name, stranger, lease.token) is False
        assert await driver.release(lock_name, stranger, None) is False
        assert await backend.validate(lock_name, lease.token)
        [result] = await driver.extend([LeaseRef(lock_name, lease.owner, lease.token, 5.0)])
        assert result is True


async def test_stale_holder_cannot_touch_successor(
    backend: asynclock.Backend, lock_name: str
) -> None:
    old = await backend.acquire(lock_name, ttl=0.3)
    asynclock.testing.force_loss(old, "test: stop renewing")
    new = await backend.acquire(lock_name, ttl=5.0, timeout=10)
    driver = backend.driver
    [result] = await driver.extend([LeaseRef(lock_name, old.owner, old.token, 5.0)])
    assert isinstance(result, Refused)
    assert await old.release() is False
    assert await backend.validate(lock_name, new.token)
    assert await new.release() is True


async def test_max_hold_bounds_a_hung_holder(backend: asynclock.Backend, lock_name: str) -> None:
    with pytest.raises(asynclock.LeaseLost) as info:
        async with backend.lock(lock_name, ttl=0.3, max_hold=0.5) as lease:
            await anyio.sleep_forever()
    assert info.value.reason == "max_hold reached"
    assert backend.stats().renewals >= 1  # it was renewed before max_hold cut it off
    async with backend.lock(lock_name, ttl=5.0, blocking=False) as after:
        assert after.token > lease.token


async def test_body_finishing_after_loss_still_raises(
    backend: asynclock.Backend, lock_name: str
) -> None:
    with pytest.raises(asynclock.LeaseLost):
        async with backend.lock(lock_name, ttl=5.0) as lease:
            asynclock.testing.force_loss(lease, "lost after the last await")


async def test_body_exception_wins_over_loss(backend: asynclock.Backend, lock_name: str) -> None:
    with pytest.raises(KeyError):
        async with backend.lock(lock_name, ttl=5.0) as lease:
            asynclock.testing.force_loss(lease, "test")
            raise KeyError("user error")


async def test_released_lease_frees_the_name(backend: asynclock.Backend, lock_name: str) -> None:
    async with backend.lock(lock_name, ttl=5.0) as lease:
        assert await lease.release() is True
        assert lease.released
        async with backend.lock(lock_name, ttl=5.0, blocking=False) as other:
            assert other.token > lease.token
    assert backend.stats().held == 0


async def test_deadline_passed_without_a_later_await_still_raises(
    backend: asynclock.Backend, lock_name: str
) -> None:
    """No await after the pause, so no watchdog ran: the exit itself must notice."""
    with pytest.raises(asynclock.LeaseLost, match="local deadline passed"):
        async with backend.lock(lock_name, ttl=0.3):
            time.sleep(0.4)  # noqa: ASYNC251 - the simulated pause, then straight to exit
    assert backend.stats().released == 0
