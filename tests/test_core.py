"""Core behaviour independent of backends: clock seam, batched renewal, stats, logging."""

from __future__ import annotations

import functools
import gc
import logging
import math
import re
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asynclock
import asynclock.testing
from asynclock.backends import Busy
from asynclock.backends.memory import MemoryDriver

pytestmark = pytest.mark.anyio


async def test_injected_clock_drives_deadlines_and_renewals() -> None:
    clock = asynclock.testing.ManualClock(1000.0)
    async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
        lease = await backend.acquire("x", ttl=9.0)
        assert lease.deadline == pytest.approx(1000.0 + 9.0 * 0.99 - 0.005)
        assert lease.remaining() == pytest.approx(9.0 * 0.99 - 0.005)
        clock.advance(3.0)  # one heartbeat (ttl/3): the renewer extends from the new now
        await asynclock.testing.next_renewal_round(backend)
        assert lease.deadline == pytest.approx(1003.0 + 9.0 * 0.99 - 0.005)
        assert backend.stats().renewals == 1
        asynclock.testing.DriverFaults(backend).fail("extend", ConnectionError("partition"))
        clock.advance(20.0)  # far past the deadline; renewals fail meanwhile
        assert await lease.lost == "local deadline passed"
        assert await lease.release() is False


async def test_one_round_trip_renews_every_lease() -> None:
    async with asynclock.testing.memory_backend() as backend:
        calls: list[int] = []

        async def counting(real: Any, leases: Any) -> Any:
            calls.append(len(leases))
            return await real(leases)

        asynclock.testing.DriverFaults(backend).around("extend", counting)
        leases = [await backend.acquire(f"n{i}", ttl=0.3) for i in range(200)]
        for _ in range(3):
            await asynclock.testing.next_renewal_round(backend)
        assert calls[-3:] == [200, 200, 200]
        stats = backend.stats()
        assert stats.renewal_round_trips == len(calls)
        assert stats.renewals == sum(calls)
        for lease in leases:
            assert await lease.release()


async def test_stats_and_hold_times() -> None:
    async with asynclock.testing.memory_backend() as backend:
        for _ in range(10):
            async with backend.lock("s", ttl=5.0):
                pass
        held = await backend.acquire("s", ttl=5.0)  # (a nested hold would be AlreadyHeld)
        with pytest.raises(asynclock.LockHeld):
            async with backend.lock("s", ttl=5.0, blocking=False):
                pass  # pragma: no cover
        assert await held.release()
        stats = backend.stats()
        assert stats.acquired == 11 and stats.released == 11 and stats.held == 0
        assert stats.busy_attempts == 1
        assert stats.hold_times.count == 11
        assert 0 <= stats.hold_times.p50 <= stats.hold_times.p99 <= stats.hold_times.max


async def test_loss_is_logged_as_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="asynclock")
    async with asynclock.testing.memory_backend() as backend:
        with pytest.raises(asynclock.LeaseLost):
            async with backend.lock("logged", ttl=5.0) as lease:
                asynclock.testing.force_loss(lease, "for the log")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "'logged'" in r.getMessage()
        and f"token={lease.token}" in r.getMessage()
        and "for the log" in r.getMessage()
        for r in warnings
    )
    debug = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "acquired 'logged'" in debug
    assert backend.stats().loss_reasons == {"for the log": 1}


async def test_one_lock_object_shared_by_tasks() -> None:
    """Ownership lives on the lease per task: a shared Lock object never mixes them up."""
    async with asynclock.testing.memory_backend() as backend:
        lock = backend.lock("shared", ttl=5.0)
        tokens: list[int] = []

        async def use() -> None:
            async with lock as lease:
                await anyio.lowlevel.checkpoint()
                tokens.append(lease.token)
                assert lease.owner in {h.owner for h in backend.held()}

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(use)
        assert sorted(tokens) == [1, 2, 3, 4, 5]
        assert len({t for t in tokens}) == 5


async def test_owner_is_random_per_acquisition() -> None:
    async with asynclock.testing.memory_backend() as backend:
        owners = set()
        for _ in range(20):
            async with backend.lock("o", ttl=5.0) as lease:
                # A 32-hex id, then this process's owner label (``~`` + its UTF-8 hex).
                owner_id, mark, label = lease.owner.partition("~")
                assert len(owner_id) == 32 and int(owner_id, 16) >= 0 and mark
                assert bytes.fromhex(label).decode() == backend.owner_label
                owners.add(lease.owner)
        assert len(owners) == 20


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"drift": 0.6}, "drift"),
        ({"drift": -0.1}, "drift"),
        ({"margin": -1}, "margin"),
        ({"margin": math.inf}, "margin"),
        ({"heartbeat": 1.0}, "heartbeat"),
        ({"release_timeout": 0}, "release_timeout"),
    ],
)
def test_bad_backend_options(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        asynclock.connect("memory://", **kwargs)


def test_driver_options_are_checked() -> None:
    with pytest.raises(TypeError, match="memory:// takes no options"):
        asynclock.connect("memory://", pool_size=3)
    with pytest.raises(TypeError, match="must be an asynclock Driver"):
        asynclock.Backend(object())  # type: ignore[arg-type]


async def test_backend_cannot_be_entered_twice() -> None:
    backend = asynclock.testing.memory_backend()
    async with backend:
        with pytest.raises(RuntimeError, match="already open"):
            async with backend:
                pass


async def test_closing_backend_loses_and_releases_held_leases() -> None:
    backend = asynclock.testing.memory_backend()
    async with backend:
        lease = await backend.acquire("kept", ttl=5.0)
        driver = backend.driver
        assert isinstance(driver, MemoryDriver)
    assert lease.lost.reason == "backend closed"
    assert "kept" not in driver.leases
    assert await lease.release() is False  # a reported no-op, also after close


async def test_lease_repr_and_check() -> None:
    async with asynclock.testing.memory_backend() as backend:
        async with backend.lock("r", ttl=5.0) as lease:
            lease.check()
            assert "token=1 held" in repr(lease)
        with pytest.raises(asynclock.LeaseLost, match="released"):
            lease.check()
        assert "released" in repr(lease)


async def test_errors_in_the_backend_block_are_not_wrapped() -> None:
    with pytest.raises(asynclock.LeaseLost):
        async with asynclock.testing.memory_backend() as backend:
            async with backend.lock("w", ttl=5.0) as lease:
                asynclock.testing.force_loss(lease, "test")
    with pytest.raises(KeyError):
        async with asynclock.testing.memory_backend():
            raise KeyError("mine")


async def test_unconfirmed_release_can_be_retried() -> None:
    async with asynclock.connect("memory://", release_timeout=0.05) as backend:
        real = backend.driver.release
        hang = True

        async def release(*args: Any) -> Any:
            if hang:
                await anyio.sleep_forever()
            return await real(*args)

        setattr(backend.driver, "release", release)  # noqa: B010
        lease = await backend.acquire("r", ttl=5.0)
        with pytest.raises(asynclock.BackendUnavailable, match="release timed out"):
            await lease.release()
        assert not lease.lost and not lease.released
        hang = False
        assert await lease.release() is True
        # Inside `async with`, a failed release is logged, not turned into LeaseLost.
        hang = True
        async with backend.lock("r2", ttl=5.0):
            pass
        assert backend.stats().losses == 0


async def test_release_timeout_keeps_the_body_exception_and_shields_outer_cancel() -> None:
    """Release runs in the holder's own scope, shielded after the body (one scope per
    hold): its deadline must not swallow the body's exception, and an outer cancel must
    not cut the release short."""
    finished = False
    async with asynclock.connect("memory://", release_timeout=0.05) as backend:
        real = backend.driver.release
        entered = anyio.Event()
        hang = True

        async def release(*args: Any) -> Any:
            entered.set()
            if hang:
                await anyio.sleep_forever()
            await anyio.lowlevel.checkpoint()  # must be shielded from the outer cancel
            return await real(*args)

        setattr(backend.driver, "release", release)  # noqa: B010
        with pytest.raises(KeyError, match="body"):
            async with backend.lock("t", ttl=5.0):
                raise KeyError("body")
        assert backend.stats().losses == 0

        hang = False
        entered = anyio.Event()
        with anyio.CancelScope() as outer:
            async with backend.lock("u", ttl=5.0):
                outer.cancel()
                await anyio.sleep_forever()
        assert outer.cancelled_caught
        assert backend.stats().released == 1
        assert not backend.held()
        finished = True
    assert finished  # a stray cancellation must not have skipped the checks above


async def test_a_hung_clean_up_after_an_interrupted_acquire_is_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelled mid-acquire, the core releases what the server may have granted; if that
    clean-up hangs, it is given up after release_timeout (logged), never waited on."""

    class Stuck(MemoryDriver):
        entered = anyio.Event()

        async def acquire(
            self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
        ) -> Any:
            self.entered.set()
            await anyio.sleep_forever()

        async def release(self, name: str, owner: str, token: int | None) -> bool:
            await anyio.sleep_forever()
            return False

    driver = Stuck()
    async with asynclock.Backend(driver, release_timeout=0.05) as backend:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(backend.acquire, "stuck", ttl=5.0))
                await driver.entered.wait()
                scope.cancel()
        assert scope.cancelled_caught
    assert "clean up acquire timed out after 0.05s" in caplog.text


async def test_driver_release_may_open_cancel_scopes() -> None:
    """The core's shielded release must not break a driver that opens scopes of its own."""

    class ScopedRelease(MemoryDriver):
        async def release(self, name: str, owner: str, token: int | None) -> bool:
            with anyio.move_on_after(1.0):
                async with anyio.create_task_group():
                    pass
                return await super().release(name, owner, token)
            return False

    async with asynclock.Backend(ScopedRelease()) as backend:
        for _ in range(3):
            async with backend.lock("scoped", ttl=5.0):
                pass
        assert backend.stats().released == 3


async def test_a_dropped_lease_alone_is_released_at_the_next_round() -> None:
    """With no other lease to renew, the round that releases a dropped lease still counts."""
    async with asynclock.testing.memory_backend() as backend:
        driver = backend.driver
        assert isinstance(driver, MemoryDriver)
        await backend.acquire("dropped", ttl=0.6)  # the Lease is thrown away at once
        gc.collect()
        with anyio.fail_after(10):
            await asynclock.testing.next_renewal_round(backend)
        assert "dropped" not in driver.leases
        assert backend.held() == []
        assert backend.stats().renewals == 0  # released, never renewed


async def test_close_waits_a_bounded_time_for_a_hung_acquisition() -> None:
    """Close waits for acquisitions in flight (so it can release what they get), but no
    longer than release_timeout: a hung server call cannot hang the close."""
    hung = anyio.Event()
    with anyio.fail_after(20):
        await _close_under_a_hung_acquire(hung)


async def _close_under_a_hung_acquire(hung: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:
        backend = asynclock.testing.memory_backend(release_timeout=0.2)

        async def acquire(*args: Any, **kwargs: Any) -> Any:
            hung.set()
            await anyio.sleep_forever()

        async def stuck() -> None:
            with pytest.raises(anyio.get_cancelled_exc_class()):
                await backend.acquire("hung", ttl=5.0)

        async with backend:
            setattr(backend.driver, "acquire", acquire)  # noqa: B010
            tg.start_soon(stuck)
            await hung.wait()
            started = anyio.current_time()
        assert anyio.current_time() - started < 5.0
        tg.cancel_scope.cancel()


def test_a_later_event_loop_in_the_same_thread_is_refused() -> None:
    """A backend opened in one asyncio.run() and used from the next one in the same thread
    (its renewer and watchdog died with the first loop) raises instead of granting leases
    nobody renews or watches."""
    import asyncio

    backend = asynclock.testing.memory_backend()
    kept: list[asynclock.Lease] = []

    async def open_and_leave() -> None:
        await backend.__aenter__()  # never closed: its loop ends under it
        kept.append(await backend.acquire("first", ttl=5.0))

    asyncio.run(open_and_leave())
    errors: list[str] = []

    async def use() -> None:
        async def hold() -> None:
            async with backend.lock("x", ttl=5.0):
                pass  # pragma: no cover

        calls: list[Any] = [
            hold,
            lambda: backend.acquire("y", ttl=5.0),
            lambda: backend.validate("first", kept[0].token),
            kept[0].release,
        ]
        for call in calls:
            try:
                await call()
            except RuntimeError as exc:
                errors.append(str(exc))

    asyncio.run(use())
    assert len(errors) == 4, errors
    assert all("belongs to the event loop it was opened in" in e for e in errors)
    driver = backend.driver
    assert isinstance(driver, MemoryDriver)
    assert set(driver.leases) == {"first"}


async def test_a_wake_while_a_retry_is_in_flight_is_not_missed() -> None:
    """A release (a driver's wake-up: a pub/sub message, a local release) that lands while
    a waiter's retry is on its way to the server must make the waiter try again at once,
    not sleep for the busy answer's ``retry_after`` (it was computed before the release).
    Seen on Redis under load: the hand-off message was read before the retry's reply, and
    the waiter sat out the reservation's ttl, losing its place in the queue."""
    async with asynclock.Backend(MemoryDriver()) as backend:
        holder = await backend.acquire("x", ttl=30.0)
        busy = 0

        async def acquire(real: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal busy
            result = await real(*args, **kwargs)
            if not isinstance(result, Busy):
                return result
            busy += 1
            if busy == 1:
                return Busy(0.001)  # retry soon: the next attempt is the one in flight
            if busy == 2:
                await holder.release()  # its wake-up lands before this reply is read
            return Busy(60.0)  # the server's answer from before the release

        asynclock.testing.DriverFaults(backend).around("acquire", acquire)
        with anyio.fail_after(10):
            async with backend.lock("x", ttl=5.0) as lease:
                assert lease.token > holder.token
        assert busy == 2


async def test_a_long_run_of_short_terms_keeps_campaigning() -> None:
    """Issue 21 item 5: the re-campaign backoff was ``BACKOFF_START * 2 ** losses`` capped
    only afterwards, so the 1,025th short term lost in a row raised OverflowError out of
    ``async for``. The clock never moves here (every term is "short": losses never reset)
    and margin=0 lets a tiny ttl cap the (real) backoff sleep at 0.1 ms."""
    clock = asynclock.testing.ManualClock(1000.0)
    terms = 0
    async with asynclock.Backend(MemoryDriver(), clock=clock, margin=0.0) as backend:
        with anyio.fail_after(30):
            async for term in backend.leadership("leader", ttl=1e-4, identity="flappy"):
                terms += 1
                async with term:
                    asynclock.testing.force_loss(term.lease, "deposed")
                    await anyio.sleep_forever()
                if terms == 1_100:
                    break
        assert backend.held() == []
    assert terms == 1_100


async def test_sync_use_of_an_async_only_object_says_async_with() -> None:
    """Issue 21 item 8: ``with backend.lock(...)`` (a forgotten ``async``) was Python's bare
    "does not support the context manager protocol"."""
    async with asynclock.testing.memory_backend() as backend:
        managers: list[tuple[object, str]] = [
            (backend.lock("x", ttl=1.0), "`async with backend.lock(...)`"),
            (backend.leadership("x", ttl=1.0), "`async with backend.leadership(...)`"),
            (asynclock.connect("memory://"), "`async with asynclock.connect(url)`"),
            (backend, "`async with asynclock.connect(url)`"),
        ]
        async with backend.leadership("x", ttl=1.0) as term:
            managers.append((term, "`async with term`"))
        for manager, words in managers:
            with pytest.raises(TypeError, match=re.escape(words) + r".* not `with`"):
                with manager:  # type: ignore[attr-defined]
                    pass  # pragma: no cover
        with pytest.raises(
            TypeError, match=r"write `async for term in backend.leadership\(...\)`.* not `for`"
        ):
            for _ in backend.leadership("x", ttl=1.0):  # type: ignore[attr-defined]
                pass  # pragma: no cover
        assert backend.held() == []


def test_a_lease_is_only_granted_never_constructed() -> None:
    with pytest.raises(TypeError, match="granted by a backend"):
        asynclock.Lease()


async def test_partitions_lost_from_a_callback_outside_any_task_are_all_handed_over() -> None:
    """A driver may tell a loss from a plain event-loop callback (ZooKeeper's session
    state, through ``call_soon_threadsafe``): there, a partition's loss hook started its
    hand-over with ``start_soon``, which raised NoEventLoopError (no task to tell the
    async library), so the driver's loop over its leases stopped at the first partition and
    the others were not told lost (seen as a new user: ZooKeeper restarted without its
    data under a partition group). The balance loop now starts the hand-over."""
    import asyncio
    import contextvars

    async with (
        asynclock.connect("memory://") as backend,
        backend.partitions("grp", count=2, ttl=5.0) as member,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(member.run, lambda partition: anyio.sleep_forever())
        changes = member.changes()
        with anyio.fail_after(10):
            while await changes.__anext__() != frozenset({0, 1}):
                pass
            first = {p.id: p for p in member.owned()}

            def lose_both() -> None:  # no task runs this: a bare callback
                for partition in first.values():
                    asynclock.testing.force_loss(partition, "session lost")

            # As from another thread (kazoo's): an empty context, no async library in it.
            asyncio.get_running_loop().call_soon(lose_both, context=contextvars.Context())
            for partition in first.values():
                await partition.lost  # handed over
                assert partition.lease.lost.reason == "session lost"
            # Handed over (released) and taken again, with higher tokens.
            while {p.id for p in member.owned()} != {0, 1} or any(
                p.token <= first[p.id].token for p in member.owned()
            ):
                await changes.__anext__()
        tg.cancel_scope.cancel()
