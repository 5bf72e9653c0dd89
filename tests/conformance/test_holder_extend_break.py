"""Issue 8's gaps, on every backend: holder()/locked(), lease.extend(ttl), break_lock()
and locked_function (what users of redis-py, python-redis-lock, pottery and etcd expect)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing
from tests.support.procs import start_worker
from tests.support.signals import BusyWatch
from tests.support.spec import BackendSpec
from tests.support.worker import fenced_write

pytestmark = pytest.mark.anyio


async def _server_ttl(backend: asynclock.Backend, name: str) -> float:
    holder = await backend.holder(name)
    assert holder is not None
    assert holder.remaining is not None
    return holder.remaining


# -- holder() and locked() --------------------------------------------------------------


async def test_holder_and_locked(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    assert await backend.holder(lock_name) is None
    assert await backend.locked(lock_name) is False
    async with backend.lock(lock_name, ttl=5.0) as lease:
        holder = await backend.holder(lock_name)
        assert holder is not None
        assert (holder.name, holder.owner, holder.token) == (lock_name, lease.owner, lease.token)
        if not spec.can("server_ttl"):
            assert holder.remaining is None
        else:
            assert holder.remaining is not None
            assert 3.0 < holder.remaining <= 5.0
        assert await backend.locked(lock_name) is True
        with pytest.raises(AttributeError):
            holder.token = 1  # type: ignore[misc]  # frozen
    assert await backend.holder(lock_name) is None
    assert await backend.locked(lock_name) is False


async def test_holder_seen_from_another_backend(shared_spec: BackendSpec, lock_name: str) -> None:
    label = "worker ünï:7 (a.b~c)"  # the marks of the owner string, inside a label
    async with shared_spec.connect(owner_label=label) as mine, shared_spec.connect() as other:
        assert mine.owner_label == label and other.owner_label != label
        async with mine.lock(lock_name, ttl=5.0) as lease:
            holder = await other.holder(lock_name)
            assert holder is not None
            assert await other.locked(lock_name)
            if shared_spec.id == "postgres":
                # Held by another session: its pid (in detail) and its token are on the
                # server, never its owner nor its label (an advisory lock has no value).
                assert (holder.owner, holder.token, holder.remaining) == (None, lease.token, None)
                assert holder.label is None and "session pid" in (holder.detail or "")
            else:
                assert (holder.owner, holder.token) == (lease.owner, lease.token)
                assert holder.label == label  # which process holds it, read from its owner
                if shared_spec.can("server_ttl"):
                    assert holder.remaining is not None and 3.0 < holder.remaining <= 5.0
                else:  # ZooKeeper: held for the holder's session
                    assert holder.remaining is None
        assert await other.holder(lock_name) is None
        assert not await other.locked(lock_name)


async def test_holder_bad_name(backend: asynclock.Backend) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        await backend.holder("")
    with pytest.raises(TypeError, match="must be a str"):
        await backend.locked(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        await backend.break_lock("")


# -- lease.extend(ttl) -------------------------------------------------------------------


async def test_extend_longer_outlives_the_first_ttl(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(20):
        async with backend.lock(lock_name, ttl=0.6) as lease:
            sent = time.monotonic()
            await lease.extend(6.0)
            assert lease.ttl == 6.0
            assert 5.0 < lease.remaining() <= 6.0 - (time.monotonic() - sent) + 0.01
            if spec.can("server_ttl"):
                assert await _server_ttl(backend, lock_name) > 5.0
            rounds = backend.stats().renewal_round_trips
            # Past the first ttl (and two of its heartbeats): still ours, renewed with the
            # new ttl, so the heartbeat runs every 2 s, not every 0.2 s.
            await anyio.sleep(1.2)
            assert not lease.lost
            assert await backend.validate(lock_name, lease.token)
            assert backend.stats().renewal_round_trips - rounds <= 1
            if spec.can("server_ttl"):
                assert await _server_ttl(backend, lock_name) > 3.5


async def test_extend_shorter_moves_the_deadline_and_the_heartbeat(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(20):
        async with backend.lock(lock_name, ttl=30.0) as lease:
            await lease.extend(1.5)
            assert lease.ttl == 1.5
            assert lease.remaining() <= 1.5
            if spec.can("server_ttl"):
                assert await _server_ttl(backend, lock_name) <= 1.5
            # The heartbeat follows the shorter ttl (every 0.5 s), or the lease would be
            # lost at its new deadline.
            for _ in range(4):  # past the new deadline
                await asynclock.testing.next_renewal_round(backend)
            assert not lease.lost
            assert await backend.validate(lock_name, lease.token)


async def test_extend_refused_loses_the_lease_loudly(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    reached = False
    with anyio.fail_after(20), pytest.raises(asynclock.LeaseLost) as outer:
        async with backend.lock(lock_name, ttl=30.0) as lease:
            await spec.sabotage(backend, lock_name)
            with pytest.raises(asynclock.LeaseLost) as inner:
                await lease.extend(10.0)
            assert lease.lost
            assert inner.value.token == lease.token
            await anyio.lowlevel.checkpoint()  # the holder's body is cancelled here
            reached = True  # pragma: no cover
    assert not reached
    assert "refused" in outer.value.reason
    assert backend.stats().losses >= 1


@pytest.mark.parametrize(
    ("ttl", "error", "words"),
    [
        (0, ValueError, "> 0"),
        (-1, ValueError, "> 0"),
        (math.nan, ValueError, "NaN"),
        (math.inf, ValueError, "finite"),
        ("5", TypeError, "number of seconds"),
        (True, TypeError, "number of seconds"),
        (0.005, ValueError, "leaves no time"),
    ],
)
async def test_extend_bad_ttl_is_refused_before_any_io(
    backend: asynclock.Backend, lock_name: str, ttl: Any, error: type[Exception], words: str
) -> None:
    async with backend.lock(lock_name, ttl=30.0) as lease:
        rounds = backend.stats().renewal_round_trips
        with pytest.raises(error, match=words):
            await lease.extend(ttl)
        assert backend.stats().renewal_round_trips == rounds
        assert lease.ttl == 30.0 and not lease.lost


async def test_extend_after_release_or_loss_raises(
    backend: asynclock.Backend, lock_name: str
) -> None:
    lease = await backend.acquire(lock_name, ttl=5.0)
    assert await lease.release()
    with pytest.raises(asynclock.LeaseLost, match="released"):
        await lease.extend(5.0)
    lease = await backend.acquire(lock_name, ttl=5.0)
    asynclock.testing.force_loss(lease, "gone for the test")
    with pytest.raises(asynclock.LeaseLost, match="gone for the test"):
        await lease.extend(5.0)


async def test_concurrent_and_cancelled_extends(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(20):
        async with backend.lock(lock_name, ttl=30.0) as lease:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease.extend, 10.0)
                await anyio.wait_all_tasks_blocked()  # the first one is under way
                tg.start_soon(lease.extend, 20.0)  # waits for the first: call order wins
            assert lease.ttl == 20.0
            if spec.can("server_ttl"):
                assert 15.0 < await _server_ttl(backend, lock_name) <= 20.0
            with anyio.move_on_after(0):
                await lease.extend(5.0)  # cancelled before the renewer sent it
            await lease.extend(8.0)
            assert lease.ttl == 8.0
            if spec.can("server_ttl"):
                assert 6.0 < await _server_ttl(backend, lock_name) <= 8.0
            assert not lease.lost


# -- break_lock() ------------------------------------------------------------------------


async def test_break_lock_here(
    backend: asynclock.Backend, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert await backend.break_lock(lock_name) is False
    with anyio.fail_after(20):
        with pytest.raises(asynclock.LeaseLost, match="broken"):
            async with backend.lock(lock_name, ttl=30.0) as lease:
                with caplog.at_level(logging.WARNING, logger="asynclock"):
                    assert await backend.break_lock(lock_name) is True
                await anyio.sleep_forever()
        assert any("break_lock" in r.getMessage() for r in caplog.records)
        # The kind stats and metrics count it under, as docs/operations.md lists it.
        assert backend.stats().loss_reasons == {"lock broken by break_lock()": 1}
        assert not await backend.locked(lock_name)
        assert not await backend.validate(lock_name, lease.token)
        async with backend.lock(lock_name, ttl=5.0, blocking=False) as after:
            assert after.token > lease.token  # G2 across a break


async def test_break_lock_of_a_holder_in_another_process(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    holder = await start_worker(shared_spec, mode="hold", name=lock_name, ttl=1.5)
    with anyio.fail_after(30):
        first = await holder.expect("acquired")
        async with shared_spec.connect() as operator:
            assert await operator.locked(lock_name)
            assert await operator.break_lock(lock_name) is True
            # The broken holder finds out at its next renewal at the latest.
            lost = await holder.expect("lost")
            assert lost["token"] == first["token"]
            async with operator.lock(lock_name, ttl=5.0, timeout=10) as after:
                assert after.token > first["token"]  # its token stays fenced off (G2)
            assert await operator.break_lock(lock_name) is False
    assert await holder.wait() == 0


async def test_a_broken_holders_late_write_is_fenced_off(
    shared_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    """Break a frozen holder's lock; the successor writes; the holder wakes, loses its lease
    and its in-flight write is refused by the fence (its token is below the successor's)."""
    fence_db = str(tmp_path / "resource.db")
    holder = await start_worker(
        shared_spec, mode="hold", name=lock_name, ttl=1.5, fence_db=fence_db
    )
    with anyio.fail_after(30):
        first = await holder.expect("acquired")
        holder.signal(signal.SIGSTOP)
        try:
            async with shared_spec.connect() as operator:
                assert await operator.break_lock(lock_name) is True
                async with operator.lock(lock_name, ttl=5.0, timeout=10) as after:
                    assert after.token > first["token"]
                    assert fenced_write(fence_db, lock_name, after.token, "successor") == "accepted"
                    holder.signal(signal.SIGCONT)
                    lost = await holder.expect("lost")
                    late = await holder.expect("late_write")
        finally:
            with contextlib.suppress(ProcessLookupError):  # it may have exited already
                holder.signal(signal.SIGCONT)
    assert lost["token"] == first["token"]
    assert late["result"] == "stale"
    assert await holder.wait() == 0


async def test_break_lock_hands_the_name_to_a_waiter(
    backend: asynclock.Backend, lock_name: str
) -> None:
    held = anyio.Event()
    got: list[int] = []

    async def hold() -> None:
        with pytest.raises(asynclock.LeaseLost):
            async with backend.lock(lock_name, ttl=30.0):
                held.set()
                await anyio.sleep_forever()

    async def wait() -> None:
        async with backend.lock(lock_name, ttl=5.0, timeout=15) as lease:
            got.append(lease.token)

    busy = BusyWatch(backend)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await held.wait()
            tg.start_soon(wait)
            holder = await backend.holder(lock_name)
            assert holder is not None
            await busy.reached(1)  # the waiter found it held (and queued)
            assert await backend.break_lock(lock_name)
    assert len(got) == 1
    assert holder is not None and holder.token is not None
    assert got[0] > holder.token


# -- locked_function ---------------------------------------------------------------------


async def test_locked_function(backend: asynclock.Backend, lock_name: str) -> None:
    inside = anyio.Event()
    release = anyio.Event()

    @backend.locked_function(lock_name + ":{invoice_id}", ttl=5.0)
    async def settle(invoice_id: int, amount: float = 1.0, *, note: str = "") -> tuple[str, int]:
        """Settle an invoice."""
        lease = asynclock.current_lease()
        if note == "wait":
            inside.set()
            await release.wait()
        return lease.name, lease.token

    assert settle.__name__ == "settle"
    assert settle.__doc__ == "Settle an invoice."
    assert str(inspect.signature(settle)) == str(
        inspect.signature(settle.__wrapped__)  # type: ignore[attr-defined]
    )
    name, token = await settle(42)
    assert name == f"{lock_name}:42"
    assert token > 0
    assert not await backend.locked(name)

    busy = backend.locked_function(lock_name + ":{invoice_id}", ttl=5.0, blocking=False)(
        settle.__wrapped__  # type: ignore[attr-defined]
    )
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: settle(7, note="wait"))
            await inside.wait()
            with pytest.raises(asynclock.LockHeld):
                await busy(invoice_id=7)
            assert (await busy(8))[0] == f"{lock_name}:8"  # another name is free
            release.set()
