"""Backend: one driver plus the core's timing, renewal, loss handling and cancellation.

Everything here is shared by every backend (STYLE: small backends, smart core):

* acquisition measures ``t_send`` before it asks and sets the local deadline to
  ``t_send + ttl * (1 - drift) - margin`` (G3);
* one renewer per backend (so per event loop) extends *all* held leases in one driver
  call per heartbeat and reports loss per lease (G7, DESIGN section 3);
* a watchdog cancels a holder whose local deadline or ``max_hold`` passes (G4);
* an interrupted acquire releases whatever the server may have granted, shielded and
  bounded; release on exit is shielded and bounded; local state changes only after the
  server confirms (G6).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import logging
import math
import os
import random
import re
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, Self, TypeVar, cast

import anyio
import anyio.abc
import anyio.lowlevel

from .bounds import ArmOnSuspend, CallBounds, shielded_call
from .clock import Clock, MonotonicClock
from .context import HOLDS as _HOLDS
from .driver import Busy, Driver, LeaseRef, Refused
from .exceptions import (
    AcquireTimeout,
    AlreadyHeld,
    AsynclockError,
    BackendUnavailable,
    LeaseLost,
    LockHeld,
)
from .holder import Holder
from .leadership import Leader, Leadership, identity_of
from .lease import Lease
from .stats import BackendStats, StatsRecorder
from .templates import NameTemplate
from .validation import (
    MAX_NAME_BYTES,
    MAX_TTL,
    check_lease_ttl,
    check_name,
    check_timeout,
    check_token,
    check_ttl,
)

logger = logging.getLogger("asynclock")
_get_ident = threading.get_ident
T = TypeVar("T")
P = ParamSpec("P")

#: How long a waiter sleeps between attempts when the driver gives no hint.
DEFAULT_POLL = 0.05
#: How long the idle renewer and watchdog sleep before looking again (no leases held).
IDLE_NAP = 1.0


class Backend:
    """A lock service: hand out leases on names, renew them, and stop holders that lose them.

    Create one with :func:`asynclock.connect` (or pass a driver for tests) and use it as an
    async context manager; it owns the background renewer of every lease it grants.

    Args:
        driver: the backend driver (see ``asynclock.backends``).
        clock: monotonic clock used for deadlines (default ``time.monotonic``).
        drift: clock-rate allowance as a fraction of ttl (default 1 %).
        margin: seconds taken off every local deadline (default 5 ms).
        heartbeat: renew every ``ttl * heartbeat`` seconds (default 1/3).
        release_timeout: bound on a release or on the clean-up of an interrupted acquire.
    """

    def __init__(
        self,
        driver: Driver,
        *,
        clock: Clock | None = None,
        drift: float = 0.01,
        margin: float = 0.005,
        heartbeat: float = 1 / 3,
        release_timeout: float = 5.0,
    ) -> None:
        if not isinstance(driver, Driver):
            raise TypeError(f"driver must be an asynclock Driver, not {type(driver).__name__}")
        if not (0 <= drift < 0.5):
            raise ValueError(f"drift must be a fraction in [0, 0.5), got {drift!r}")
        if not (0 <= margin < math.inf):
            raise ValueError(f"margin must be a finite number of seconds >= 0, got {margin!r}")
        if not (0 < heartbeat < 1):
            raise ValueError(f"heartbeat must be a fraction of ttl in (0, 1), got {heartbeat!r}")
        check_ttl(release_timeout, what="release_timeout")
        self.driver = driver
        self.clock: Clock = clock or MonotonicClock()
        self.drift = drift
        self.margin = margin
        self.heartbeat = heartbeat
        # owner -> (weak reference to the Lease, name, token): a lease nobody references
        # any more is not renewed but released, with a warning (see _reap_dropped).
        self._held: dict[str, _Held] = {}
        self._dropped: list[weakref.ref[Lease]] = []  # appended by the weakref callback
        self._on_collected = self._dropped.append
        self._bounds = CallBounds(self.clock, release_timeout)
        self._owner_prefix = os.urandom(12).hex()
        self._owner_seq = itertools.count(1)
        self._stats = StatsRecorder()
        self._release_events: dict[str, anyio.Event] = {}
        self._renew_wake: anyio.CancelScope | None = None
        self._watch_wake: anyio.CancelScope | None = None
        self._next_round: float = math.inf
        self._renew_asap = False  # renew_now() asked for a round after the current one
        self._watch_until: float = -math.inf  # what the watchdog sleeps until, if it sleeps
        self._round_done = anyio.Event()
        #: ``lease.extend(ttl)`` requests for the renewer's next round, by owner.
        self._extends: dict[str, _ExtendRequest] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._scope_type: type[anyio.CancelScope] = anyio.CancelScope
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = (
            anyio.lowlevel.checkpoint_if_cancelled
        )
        self._open = False
        # Waiters' cancel scopes (cancelled when the backend closes) and the number of
        # acquisitions in flight (close waits for them to settle before it closes the driver).
        self._waiters: set[anyio.CancelScope] = set()
        self._pending = 0
        self._settled: anyio.Event | None = None
        # The thread whose event loop opened the backend: every acquire, validate and
        # release compares it with the running thread's id (~30 ns; asking for the running
        # loop itself costs ~10 times that on the hold fast path). Another loop in the
        # same thread (a later asyncio.run) is caught where the running task is looked up
        # anyway: asyncio's current task *of the opening loop* is None there.
        self._thread: int | None = None
        self._opened_in = "no event loop (not open)"
        self._current_task: Callable[[], object] = _any_current_task
        driver.bind(self.clock, self._wake_waiters, self._lost_out_of_band, self._renew_soon)

    def __repr__(self) -> str:
        return f"<asynclock.Backend {self.driver.display} held={len(self._live())}>"

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._open:
            raise RuntimeError("this backend is already open; use one `async with` per backend")
        # The running event loop's cancel scope class: holder scopes are made directly,
        # skipping anyio's per-call back-end lookup (a measurable part of a fast hold).
        self._scope_type = type(anyio.CancelScope())
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled_for(self._scope_type)
        self._current_task = _current_task_function(self._scope_type)
        self._thread = _get_ident()
        self._opened_in = _describe_loop()
        await self.driver.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._open = True
        self._tg.start_soon(self.driver.background, name=f"asynclock {self.driver.display}")
        self._tg.start_soon(self._renew_loop, name="asynclock renewer")
        self._tg.start_soon(self._watchdog_loop, name="asynclock watchdog")
        self._tg.start_soon(self._bounds.run, name="asynclock release deadlines")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._open = False
        # Waiters raise BackendUnavailable; a lease granted from now on is released by
        # the task that asked for it (see _acquire). Wait (bounded) for them to settle,
        # so their clean-up still has a driver to talk to.
        for scope in list(self._waiters):
            scope.cancel()
        if self._pending:
            self._settled = anyio.Event()
            with anyio.move_on_after(self.release_timeout, shield=True):
                await self._settled.wait()
        held = self._live()
        for lease in held:
            self._lose(lease, "backend closed")
        with anyio.CancelScope(shield=True):
            for lease in held:
                await self._release(lease, quiet=True)
            await self._reap_dropped()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        # Hand the task group only a cancellation (it may be its own, from a crashed
        # background task); anything else the body raised propagates as it is, never
        # wrapped in an ExceptionGroup.
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
        try:
            if cancelled:
                return await self._tg.__aexit__(exc_type, exc, tb)
            await self._tg.__aexit__(None, None, None)
            return None
        finally:
            # Closed: nothing runs on the loop any more (and the loop is not kept alive).
            self._current_task = _any_current_task
            with anyio.CancelScope(shield=True):
                await self.driver.aclose()

    @property
    def release_timeout(self) -> float:
        """Bound (seconds) on a release or on the clean-up of an interrupted acquire."""
        return self._bounds.timeout

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                "backend is not open: use `async with asynclock.connect(url) as backend:`"
            )

    def _check_loop(self) -> None:
        """Raise unless called from a task of the event loop that opened the backend."""
        if _get_ident() != self._thread or self._current_task() is None:
            self._wrong_loop()

    def _wrong_loop(self) -> None:
        """Raise: this backend is used from an event loop other than the one it opened in."""
        raise RuntimeError(
            f"this {self.driver.display} backend belongs to the event loop it was opened in "
            f"({self._opened_in}) but was used from another one ({_describe_loop()}); open "
            "one backend per event loop (per thread)"
        )

    # -- public API ------------------------------------------------------------------------

    def lock(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lock:
        """An async context manager that holds ``name`` for the body and yields the Lease.

        The body runs in a cancel scope that is cancelled when the lease is lost; the
        ``async with`` then raises :class:`LeaseLost`. Busy with ``blocking=False`` raises
        :class:`LockHeld`; not acquired within ``timeout`` raises :class:`AcquireTimeout`.

        ``token_scope`` (a str validated like a name) draws the token from the scope's
        counter as well as the name's: every lease taken with one scope gets a token
        greater than every earlier token of that scope, whatever its name (G2 per scope),
        and still greater than every earlier token of the name. Use it when one logical
        job locks a new name per occurrence (``"nightly@2026-12-01T03:00"``) and its
        writes must be fenced in order.
        """
        lock = Lock.__new__(Lock)  # skip a frame: one Lock is often made per hold
        lock._backend = self
        lock._args = _check_lock_args(name, ttl, timeout, blocking, max_hold)
        lock._token_scope = None if token_scope is None else _check_scope(token_scope)
        return lock

    async def acquire(
        self,
        name: str,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
        token_scope: str | None = None,
    ) -> Lease:
        """Acquire without a context manager. You must ``await lease.release()``.

        No cancel scope guards your work here: watch ``lease.lost`` or call
        ``lease.check()`` before side effects, and fence your writes with ``lease.token``.
        ``token_scope``: as in :meth:`lock`.
        """
        args = _check_lock_args(name, ttl, timeout, blocking, max_hold)
        if self._open and self._current_task() is None:
            self._wrong_loop()
        scope = None if token_scope is None else _check_scope(token_scope)
        return await self._acquire(*args, token_scope=scope)

    async def validate(self, name: str, token: int) -> bool:
        """True if ``token`` is the live holder's token for ``name`` right now (G9)."""
        self._require_open()
        self._check_loop()
        check_name(name)
        check_token(token)
        return bool(await self._call("validate", self.driver.validate(name, token)))

    def stats(self) -> BackendStats:
        """A snapshot of counters and hold-time percentiles since the backend opened."""
        return self._stats.snapshot(held=len(self._live()))

    def held(self) -> list[Lease]:
        """The leases this backend currently holds (and renews)."""
        return self._live()

    def _live(self) -> list[Lease]:
        return [lease for ref, _, _ in list(self._held.values()) if (lease := ref()) is not None]

    async def _renewal_round(self) -> None:
        """Wait until the renewer finishes its next round trip (for tests and tools)."""
        await self._round_done.wait()

    # -- acquisition -----------------------------------------------------------------------

    async def _acquire(
        self,
        name: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        owner_tag: str = "",
        token_scope: str | None = None,
    ) -> Lease:
        if not self._open:
            self._require_open()
        if _get_ident() != self._thread:
            self._wrong_loop()
        await self._checkpoint_if_cancelled()
        if ttl * (1 - self.drift) - self.margin <= 0:
            raise ValueError(
                f"ttl={ttl:g}s leaves no time after drift ({self.drift:.0%}) and margin "
                f"({self.margin:g}s); use a ttl of at least {2 * self.margin + 0.001:g}s"
            )
        # Unique per acquisition: 96 random bits per backend plus a counter (a syscall for
        # fresh randomness on every acquisition showed up in the fast path).
        owner = f"{self._owner_prefix}{next(self._owner_seq):08x}{owner_tag}"
        self._pending += 1
        try:
            # The first attempt, inline (the loop in _wait repeats it): most acquisitions
            # succeed here, and a call less is measurable on the fast path.
            t_send = self.clock.now()
            try:
                if token_scope is None:
                    result = await self.driver.acquire(name, owner, ttl, queue=blocking)
                else:
                    result = await self.driver.acquire(
                        name, owner, ttl, queue=blocking, scope=token_scope
                    )
            except BaseException as exc:
                await self._undo_acquire(name, owner, exc)
                raise  # _undo_acquire raised the wrapped error for plain exceptions
            if not isinstance(result, Busy):
                if self._open:
                    return self._grant(name, owner, result, ttl, t_send, max_hold)
                await self._refuse_grant(name, owner, result)
            return await self._wait(
                name, owner, ttl, t_send, timeout, blocking, max_hold, result, token_scope
            )
        except BaseException:
            if blocking:  # leave the wait queue (after any clean-up of the attempt)
                await self._shielded(self.driver.abandon(name, owner), "abandon wait")
            raise
        finally:
            self._pending -= 1
            if self._settled is not None and not self._pending:
                self._settled.set()

    async def _refuse_grant(self, name: str, owner: str, token: int) -> NoReturn:
        """Granted after close began: nobody would renew it, so give it back and raise."""
        await self._shielded(self.driver.release(name, owner, token), "release after close")
        raise BackendUnavailable(
            f"{self.driver.display}: backend closed while acquiring {name!r}; "
            "the lease it granted meanwhile was released"
        )

    async def _undo_acquire(self, name: str, owner: str, exc: BaseException) -> None:
        """An attempt was interrupted or failed: the server may have granted it (G6)."""
        driver = self.driver
        await self._shielded(driver.release(name, owner, None), "clean up acquire")
        if isinstance(exc, Exception) and not isinstance(exc, AsynclockError):
            raise BackendUnavailable(
                f"{driver.display}: acquire of {name!r} failed: {exc!r}"
            ) from exc

    async def _wait(
        self,
        name: str,
        owner: str,
        ttl: float,
        started: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        result: Busy,
        token_scope: str | None = None,
    ) -> Lease:
        """After a failed first attempt: wait for a release and try again (or give up)."""
        driver, clock = self.driver, self.clock
        give_up_at = None if timeout is None else started + timeout
        watching = False
        # Cancelled when the backend closes: a waiter must not outlive its backend (nobody
        # would renew what it got).
        closing = self._scope_type()
        self._waiters.add(closing)
        try:
            with closing:
                while True:
                    self._stats.busy_attempts += 1
                    if not blocking:
                        raise LockHeld(name, result.retry_after, result.detail)
                    now = clock.now()
                    if give_up_at is not None and now >= give_up_at:
                        assert timeout is not None
                        raise AcquireTimeout(name, timeout)
                    # Listen for local releases from now on (no await since the attempt).
                    released = self._release_events.get(name)
                    if released is None:
                        released = self._release_events[name] = anyio.Event()
                    retry_now = False
                    if not watching:
                        watching = True
                        # A release between the failed attempt and a new subscription could
                        # be missed: the driver says whether to try again at once.
                        retry_now = bool(await self._call("watch", driver.watch(name)))
                    if not retry_now:
                        delay = DEFAULT_POLL if result.retry_after is None else result.retry_after
                        delay = delay * (1 + 0.1 * random.random()) + 0.0005 * random.random()
                        if give_up_at is not None:
                            delay = min(delay, give_up_at - now)
                        with anyio.move_on_after(max(0.0, delay)):
                            await released.wait()
                    t_send = clock.now()
                    try:
                        if token_scope is None:
                            attempt = await driver.acquire(name, owner, ttl, queue=blocking)
                        else:
                            attempt = await driver.acquire(
                                name, owner, ttl, queue=blocking, scope=token_scope
                            )
                    except BaseException as exc:
                        await self._undo_acquire(name, owner, exc)
                        raise
                    if not isinstance(attempt, Busy):
                        if self._open:
                            return self._grant(name, owner, attempt, ttl, t_send, max_hold)
                        await self._refuse_grant(name, owner, attempt)
                    result = attempt
            raise BackendUnavailable(
                f"{driver.display}: backend closed while waiting for lock {name!r}"
            )
        finally:
            self._waiters.discard(closing)
            if watching:
                await self._shielded(driver.unwatch(name), "unwatch")

    def _grant(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        t_send: float,
        max_hold: float | None,
    ) -> Lease:
        deadline = t_send + ttl * (1 - self.drift) - self.margin
        hard = None if max_hold is None else t_send + max_hold
        lease = Lease(name, owner, token, ttl, self.clock, t_send, deadline, hard, self)
        self._held[owner] = (weakref.ref(lease, self._on_collected), name, token)
        self._stats.acquired += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("acquired %r token=%d ttl=%gs", name, token, ttl)
        first_renewal = t_send + ttl * self.heartbeat
        if first_renewal < self._next_round:
            self._next_round = first_renewal
            _poke(self._renew_wake)
        if (deadline if hard is None else min(deadline, hard)) < self._watch_until:
            _poke(self._watch_wake)
        return lease

    def _wake_waiters(self, name: str) -> None:
        event = self._release_events.pop(name, None)
        if event is not None:
            event.set()

    # -- release ---------------------------------------------------------------------------

    async def _release(
        self, lease: Lease, *, quiet: bool = False, scope: anyio.CancelScope | None = None
    ) -> bool:
        """Release ``lease`` at the server (G6).

        ``scope``: a shielded cancel scope the caller is inside and owns (the holder's own
        scope, shield turned on after the body); the release then runs in it instead of a
        new one, and its deadline bounds the call.
        """
        if _get_ident() != self._thread:
            self._wrong_loop()
        # Stop renewing first: renewal is tied to the holder's life, never outlives it.
        self._held.pop(lease.owner, None)
        if self._extends:
            self._end_extend(lease, Refused("released"))
        if lease._released:
            return False
        now = self.clock.now()
        if lease.lost.reason is None and now >= lease.deadline:
            # The loop was blocked past the deadline, so the watchdog never got to run.
            self._lose(lease, _deadline_reason(lease, now))
        was_lost = lease.lost.reason is not None
        ok: bool | None = None
        error: BaseException | None = None
        call = self.driver.release(lease.name, lease.owner, lease.token)
        try:
            if scope is None:
                ok = await shielded_call(call, self._bounds)
            else:
                # Run the call up to its first suspension right here: most releases
                # (SQLite, memory) finish without one and need no timer at all.
                try:
                    first = call.send(None)
                except StopIteration as done:
                    ok = done.value
                else:
                    ok = await ArmOnSuspend(call, scope, self._bounds, first)
        except Exception as exc:
            error = exc
        except anyio.get_cancelled_exc_class():
            if scope is None or not scope.cancel_called:
                raise
            # Our own deadline (release_timeout) fired: report it as a timeout below; the
            # caller exits the scope next, with no await in between.
        if ok is None:
            # Unconfirmed: keep the lease as it is so `release()` can be retried; renewal
            # has stopped, so the server lets it expire within its ttl either way.
            why = f"release failed: {error!r}" if error else "release timed out"
            why += f"; the server expires it within its ttl ({lease.ttl:g}s)"
            if quiet or was_lost:
                logger.warning("release of %r token=%d: %s", lease.name, lease.token, why)
                return False
            raise BackendUnavailable(f"{self.driver.display}: {why}") from error
        self._stats.hold_times.append(now - lease.acquired_at)
        if ok and not was_lost:
            lease._released = True
            self._stats.released += 1
            if self._release_events:
                self._wake_waiters(lease.name)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("released %r token=%d", lease.name, lease.token)
            return True
        if ok:
            # Lost locally (deadline) but still ours at the server: freed early, still lost.
            lease._released = True
            self._wake_waiters(lease.name)
            return False
        if not was_lost:
            self._lose(lease, "lease had already ended at the server when released")
        logger.info(
            "release of %r token=%d was a no-op: lease already lost", lease.name, lease.token
        )
        return False

    async def _let_expire(self, lease: Lease) -> bool:
        """Extend ``lease`` once more (owner-checked, G5), then stop renewing it."""
        self._check_loop()
        entry = self._held.get(lease.owner)
        if entry is None or entry[0]() is not lease or lease._released:
            return False
        ref = LeaseRef(lease.name, lease.owner, lease.token, lease.ttl)
        result: object = None
        try:
            results = await shielded_call(self.driver.extend([ref]), self._bounds)
            result = None if results is None else results[0]
        except Exception as exc:
            result = exc
        if isinstance(result, Refused):
            self._lose(lease, f"renewal refused: {result.reason}")
            return False
        # Stop renewing; from here on only the server's ttl keeps the name taken.
        self._held.pop(lease.owner, None)
        lease._released = True
        self._stats.released += 1
        return result is True

    # -- loss ------------------------------------------------------------------------------

    def _lost_out_of_band(self, name: str, owner: str, reason: str) -> None:
        entry = self._held.get(owner)
        lease = None if entry is None else entry[0]()
        if lease is not None and lease.name == name:
            self._lose(lease, reason)

    def _lose(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` lost (once), stop renewing it and cancel its holder (G4)."""
        self._held.pop(lease.owner, None)
        if self._extends:
            self._end_extend(lease, Refused(reason))
        if lease.lost:
            return
        lease.lost._set(reason)
        self._count_loss(lease, reason)
        if lease._scope is not None:
            lease._scope.cancel()

    def _count_loss(self, lease: Lease, reason: str) -> None:
        self._stats.losses += 1
        self._stats.loss_reasons[re.split(r"[:;(]", reason, maxsplit=1)[0].strip()] += 1
        logger.warning("lease lost: %r token=%d: %s", lease.name, lease.token, reason)

    def _renew_soon(self) -> None:
        """The driver's ``renew_now``: renew every held lease now, not at the next heartbeat
        (a connection came back; the server may have restarted and lost them)."""
        self._renew_asap = True
        if self._held:
            self._next_round = self.clock.now()
            _poke(self._renew_wake)

    # -- background loops ------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        failures = 0
        idle = IDLE_NAP
        while True:
            if not self._held and self._next_round <= self.clock.now():
                # Nap instead of parking at infinity: a grant within the nap then needs no
                # wake-up call (tight acquire/release loops stay cheap).
                self._next_round = self.clock.now() + idle
            await self._sleep_until(self._next_round, "_renew_wake")
            if self._dropped:
                await self._reap_dropped()
                if not self._held:  # nothing left to renew: this was the round
                    self._round_done.set()
                    self._round_done = anyio.Event()
            if not self._held:
                continue
            now = self.clock.now()
            if now < self._next_round:
                continue
            batch = self._live()
            if not batch:
                continue
            period = min(lease.ttl for lease in batch) * self.heartbeat
            idle = min(period, IDLE_NAP)
            refs = [LeaseRef(lease.name, lease.owner, lease.token, lease.ttl) for lease in batch]
            # lease.extend(ttl) requests ride this round with their new ttl (one renewer:
            # rounds never overlap, so the server's expiry is the last one we sent).
            asked = self._extends_for(refs) if self._extends else None
            t_send = self.clock.now()
            self._renew_asap = False
            results: list[object]
            try:
                with anyio.fail_after(max(period, 0.01)):
                    results = list(await self.driver.extend(refs))
                if len(results) != len(refs):
                    raise RuntimeError(f"driver returned {len(results)} results for {len(refs)}")
            except Exception as exc:
                results = [exc] * len(refs)
            self._stats.renewal_round_trips += 1
            errors = 0
            for lease, ref, result in zip(batch, refs, results, strict=True):
                request = asked.get(lease.owner) if asked else None
                entry = self._held.get(lease.owner)
                if entry is None or entry[0]() is not lease:
                    if request is not None:
                        self._end_extend(lease, Refused(lease.lost.reason or "released"), request)
                    continue  # released or lost while we were asking
                if request is not None:
                    self._extended(lease, ref, result, t_send)
                    self._end_extend(lease, result, request)
                    continue
                if result is True:
                    deadline = t_send + lease.ttl * (1 - self.drift) - self.margin
                    if deadline > lease._deadline:
                        lease._deadline = deadline
                    self._stats.renewals += 1
                elif isinstance(result, Refused):
                    self._lose(lease, f"renewal refused: {result.reason}")
                else:
                    errors += 1
                    logger.debug("renewal of %r failed, will retry: %r", lease.name, result)
            self._round_done.set()
            self._round_done = anyio.Event()
            if errors:
                self._stats.renewal_errors += errors
                failures += 1
                backoff = min(period, 0.02 * 2 ** min(failures, 10)) * (0.5 + random.random() / 2)
                self._next_round = self.clock.now() + backoff
            else:
                failures = 0
                self._next_round = t_send + period
            if asked is not None or self._extends:
                # A ttl changed (the period with it), or an extend waits for a round.
                self._next_round = self._after_extends(t_send, errors > 0)
            if self._renew_asap:  # asked during this round: its answers may predate it
                self._next_round = self.clock.now()

    async def _watchdog_loop(self) -> None:
        while True:
            now = self.clock.now()
            earliest = min((lease.deadline for lease in self._live()), default=now + IDLE_NAP)
            if now < earliest:
                self._watch_until = earliest
                await self._sleep_until(earliest, "_watch_wake")
                self._watch_until = -math.inf
                continue
            for lease in self._live():
                if now >= lease.deadline:
                    self._lose(lease, _deadline_reason(lease, now))

    async def _reap_dropped(self) -> None:
        """Release the leases that were garbage-collected unreleased (nobody can use them,
        so nobody may keep the name), and say so like an unclosed file's ResourceWarning."""
        while self._dropped:  # drain first: a lease collected from now on flags again
            self._dropped.pop()
        for owner, entry in list(self._held.items()):
            if entry[0]() is not None or self._held.get(owner) is not entry:
                continue  # alive, or released while we were releasing another one
            del self._held[owner]
            _, name, token = entry
            logger.warning(
                "lease on %r (token %d) was garbage-collected without release(): releasing "
                "it; call `await lease.release()`, or hold it with `async with "
                "backend.lock(...)`",
                name,
                token,
            )
            await self._shielded(self.driver.release(name, owner, token), "release dropped")
            self._wake_waiters(name)

    async def _sleep_until(self, when: float, slot: str) -> None:
        with anyio.CancelScope() as scope:
            setattr(self, slot, scope)
            if when == math.inf:
                await anyio.sleep_forever()
            else:
                await self.clock.sleep_until(when)
        setattr(self, slot, None)

    # -- helpers ---------------------------------------------------------------------------

    async def _shielded(self, call: Awaitable[Any], what: str) -> None:
        """A clean-up call, shielded and bounded like a release; failures are logged."""

        async def run() -> bool:
            await call
            return True

        try:
            done = await shielded_call(run(), self._bounds)
        except Exception as exc:
            logger.debug("%s failed: %r", what, exc)
            return
        if done is None:
            logger.warning("%s timed out after %gs", what, self.release_timeout)

    async def _call(self, what: str, call: Awaitable[object]) -> object:
        try:
            return await call
        except AsynclockError:
            raise
        except Exception as exc:
            raise BackendUnavailable(f"{self.driver.display}: {what} failed: {exc!r}") from exc

    # -- who holds it, changing a ttl, breaking a lock, decorating a function --------------

    async def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` right now, as the server sees it, or ``None`` if nobody does.

        A snapshot (the lease may end the moment after): for dashboards and operators, not
        for deciding who may write (fence writes with your lease's token). Fields a backend
        cannot know are ``None``; see :class:`~asynclock.Holder`.
        """
        self._require_open()
        self._check_loop()
        check_name(name)
        try:
            result = await self.driver.holder(name)
        except (AsynclockError, NotImplementedError):
            raise
        except Exception as exc:
            raise BackendUnavailable(f"{self.driver.display}: holder failed: {exc!r}") from exc
        return result

    async def locked(self, name: str) -> bool:
        """True if some lease holds ``name`` right now (a snapshot, as :meth:`holder`)."""
        return await self.holder(name) is not None

    async def break_lock(self, name: str) -> bool:
        """Remove whoever holds ``name`` (for operators); True if a live lease was removed.

        Logged at WARNING. The broken holder, in any process, loses its lease at its next
        renewal at the latest (its ``async with`` raises :class:`LeaseLost`), and its token
        stays fenced off: the next acquisition's token is larger. Unlike a release this is
        not owner-checked, so it can end a healthy holder's lease: use it for a holder
        that is stuck, not to take a lock. PostgreSQL ``mode=session`` ends the holder's
        database session, and with it every lock that session holds.
        """
        self._require_open()
        self._check_loop()
        check_name(name)
        logger.warning("break_lock(%r) on %s: removing whoever holds it", name, self.driver.display)
        try:
            broken = bool(await self.driver.break_lock(name))
        except (AsynclockError, NotImplementedError):
            raise
        except Exception as exc:
            raise BackendUnavailable(f"{self.driver.display}: break_lock failed: {exc!r}") from exc
        if broken:
            logger.warning("break_lock(%r): a live lease was removed", name)
            # A holder on this very backend need not wait for its next renewal.
            for lease in [lease for lease in self._live() if lease.name == name]:
                self._lose(lease, "lock broken by break_lock()")
        return broken

    def locked_function(
        self,
        name: str,
        /,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
        """Decorate an ``async def`` function so every call runs holding a lock.

        ``name`` is a :class:`~asynclock.NameTemplate` formatted from the call's arguments
        (``"invoice:{invoice_id}"``); the other arguments are those of :meth:`lock`. Inside
        the call :func:`asynclock.current_lease` is the lease, and a lost lease cancels the
        call, which raises :class:`LeaseLost`.

        Raises:
            TypeError: at decoration, if the function is not an ``async def`` function or
                the template names an argument it does not take.
            ValueError: at decoration, for a malformed template or bad lock arguments.
        """
        template = NameTemplate(name)
        # The lock arguments are checked now, not at the first call.
        _check_lock_args("name", ttl, timeout, blocking, max_hold)

        def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
            if not inspect.iscoroutinefunction(func):
                kind = "an async generator" if inspect.isasyncgenfunction(func) else "not async"
                raise TypeError(
                    f"locked_function needs an `async def` function; "
                    f"{getattr(func, '__qualname__', func)!s} is {kind} (for sync code, hold "
                    "the lock around the call with `async with backend.lock(...)`)"
                )
            template.check_callable(func)
            signature = inspect.signature(func)

            @functools.wraps(func)
            async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
                lock_name = template.format_call(func, args, kwargs)
                lock = self.lock(
                    lock_name, ttl=ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
                )
                async with lock as lease:
                    return await func(*args, **kwargs)
                # Only a lost lease's cancellation is swallowed, and then __aexit__ raises.
                raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost")

            locked_call.__signature__ = signature  # type: ignore[attr-defined]
            return locked_call

        return decorate

    async def _extend_lease(self, lease: Lease, ttl: object) -> None:
        """``lease.extend(ttl)``: the renewer's next round, now, carries the new ttl."""
        self._check_loop()
        new_ttl = check_lease_ttl(ttl)
        if new_ttl * (1 - self.drift) - self.margin <= 0:
            raise ValueError(
                f"ttl={new_ttl:g}s leaves no time after drift ({self.drift:.0%}) and margin "
                f"({self.margin:g}s); use a ttl of at least {2 * self.margin + 0.001:g}s"
            )
        while True:
            lease.check()  # lost, released or past its deadline: LeaseLost, before any I/O
            entry = self._held.get(lease.owner)
            if entry is None or entry[0]() is not lease:
                raise LeaseLost(lease.name, lease.token, "no longer renewed by this backend")
            pending = self._extends.get(lease.owner)
            if pending is None:
                break
            await pending.done.wait()  # one ttl change at a time, in call order
        request = self._extends[lease.owner] = _ExtendRequest(new_ttl)
        self._next_round = self.clock.now()
        _poke(self._renew_wake)
        try:
            await request.done.wait()
        finally:
            if self._extends.get(lease.owner) is request:
                del self._extends[lease.owner]  # cancelled before the renewer sent it
            request.done.set()  # an extend queued behind this one may go now
        result = request.result
        if result is True:
            return
        if lease.lost.reason is not None:
            raise LeaseLost(lease.name, lease.token, lease.lost.reason)
        if isinstance(result, Refused):
            raise LeaseLost(lease.name, lease.token, result.reason)
        raise BackendUnavailable(
            f"{self.driver.display}: extend of {lease.name!r} to ttl={new_ttl:g}s failed "
            f"(the lease keeps renewing with ttl={lease.ttl:g}s): {result!r}"
        ) from (result if isinstance(result, BaseException) else None)

    def _extends_for(self, refs: list[LeaseRef]) -> dict[str, _ExtendRequest]:
        """The extend requests this round sends; their refs get the new ttl (in place)."""
        asked: dict[str, _ExtendRequest] = {}
        for i, ref in enumerate(refs):
            request = self._extends.get(ref.owner)
            if request is not None and not request.sent:
                request.sent = True
                asked[ref.owner] = request
                refs[i] = LeaseRef(ref.name, ref.owner, ref.token, request.ttl)
        return asked

    def _extended(self, lease: Lease, ref: LeaseRef, result: object, t_send: float) -> None:
        """Apply the answer to ``lease.extend(ref.ttl)`` sent at ``t_send`` (G3, G4)."""
        deadline = t_send + ref.ttl * (1 - self.drift) - self.margin
        if result is True:
            lease.ttl = ref.ttl
            lease._deadline = deadline  # may move earlier: a shorter ttl
            self._stats.renewals += 1
        elif isinstance(result, Refused):
            self._lose(lease, f"extend refused: {result.reason}")
            return
        elif deadline < lease._deadline:
            # Unknown whether the server took the shorter ttl: assume it did.
            lease._deadline = deadline
        else:
            return
        if lease.deadline < self._watch_until:
            _poke(self._watch_wake)

    def _end_extend(
        self, lease: Lease, result: object, request: _ExtendRequest | None = None
    ) -> None:
        """Answer ``request`` (default: the lease's pending one) with ``result``."""
        pending = self._extends.get(lease.owner)
        if request is None:
            request = pending
        if request is None:
            return
        if pending is request:
            del self._extends[lease.owner]
        request.result = result
        request.done.set()

    def _after_extends(self, t_send: float, backing_off: bool) -> float:
        """When the next round runs after one that changed a ttl or left a request."""
        if any(not request.sent for request in self._extends.values()):
            return self.clock.now()
        live = self._live()
        if not live:
            return self._next_round
        # The period of the ttls now held (this round's was computed from the old ones).
        shortest = min(lease.ttl for lease in live) * self.heartbeat
        if backing_off:
            return min(self._next_round, t_send + shortest)
        return t_send + shortest

    # -- leader election (asynclock/_core/leadership.py) ------------------------------------

    def leadership(self, name: str, *, ttl: float, identity: str | None = None) -> Leadership:
        """Campaign for leadership of ``name``; ``identity`` (default ``host:pid``) is what
        :meth:`leader` tells other processes.

        ``async with backend.leadership(name, ttl=...) as term:`` waits until elected and
        yields a :class:`Term`; the body is cancelled when the term is lost and the block
        raises :class:`LeaseLost`. ``async for term in backend.leadership(...):`` with
        ``async with term:`` inside campaigns again after each loss (with backoff) until
        the loop is left.
        """
        return Leadership(self, name, ttl, identity)

    async def leader(self, name: str) -> Leader | None:
        """Who leads ``name`` now (its identity and token), or None if nobody holds it.

        Raises NotImplementedError on backends whose server keeps no owner for a lock
        (postgres ``mode=session``, redlock).
        """
        self._require_open()
        check_name(name)
        try:
            found = await self.driver.owner_of(name)
        except (AsynclockError, NotImplementedError):
            raise
        except Exception as exc:
            raise BackendUnavailable(f"{self.driver.display}: leader failed: {exc!r}") from exc
        if found is None:
            return None
        return Leader(identity_of(found[0]), found[1])


class _ExtendRequest:
    """One ``lease.extend(ttl)`` waiting for the renewer's answer."""

    __slots__ = ("done", "result", "sent", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.sent = False
        self.result: object = None
        self.done = anyio.Event()


def _checkpoint_if_cancelled_for(
    scope_type: type[anyio.CancelScope],
) -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint_if_cancelled`` without its per-call event loop lookup.

    A backend is bound to one event loop, so the loop's anyio back-end class (found the
    way anyio finds it: the ``backend_class`` of the module defining its cancel scope) is
    looked up once; the public function is the fallback if that ever changes.
    """
    backend_class = getattr(sys.modules.get(scope_type.__module__), "backend_class", None)
    method = getattr(backend_class, "checkpoint_if_cancelled", None)
    if callable(method):
        return cast(Callable[[], Awaitable[None]], method)
    return anyio.lowlevel.checkpoint_if_cancelled


#: What the backend keeps per held lease: a weak reference (the holder keeps the Lease
#: alive), and the name and token to release it with once it is collected.
_Held = tuple["weakref.ref[Lease]", str, int]


def _any_current_task() -> object:
    return anyio.get_current_task().id


def _current_task_function(scope_type: type[anyio.CancelScope]) -> Callable[[], object]:
    """A cheap way to name the running task on the event loop whose cancel scope class is
    ``scope_type`` (the anyio back-end is known once the backend opens)."""
    module = scope_type.__module__
    if module.endswith("._asyncio"):
        import asyncio

        # Passing the loop skips the running-loop lookup (half the cost of the call).
        return functools.partial(asyncio.current_task, asyncio.get_running_loop())
    if module.endswith("._trio"):
        lowlevel = importlib.import_module("trio.lowlevel")  # present: trio is running
        return cast(Callable[[], object], lowlevel.current_task)
    return _any_current_task


def _describe_loop() -> str:
    import asyncio

    thread = threading.current_thread()
    try:
        loop = asyncio.get_running_loop()
        where = f"{type(loop).__name__} {id(loop):#x}"
    except RuntimeError:
        where = "the event loop"  # trio, or not in an event loop at all
    return f"{where} in thread {thread.name!r} ({thread.ident})"


def _deadline_reason(lease: Lease, now: float) -> str:
    hard = lease.hard_deadline is not None and now >= lease.hard_deadline
    return "max_hold reached" if hard else "local deadline passed"


def _poke(scope: anyio.CancelScope | None) -> None:
    if scope is not None:
        scope.cancel()


def _check_scope(scope: object) -> str:
    if not isinstance(scope, str):
        raise TypeError(f"token_scope must be a str or None, not {type(scope).__name__}")
    try:
        return check_name(scope)
    except ValueError as exc:
        raise ValueError(f"token_scope: {exc} (it is validated like a lock name)") from None


def _check_lock_args(
    name: object, ttl: object, timeout: object, blocking: object, max_hold: object
) -> tuple[str, float, float | None, bool, float | None]:
    # Fast path for the usual call, `backend.lock(name, ttl=...)` (made on every hold).
    if (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_BYTES // 4
        and name.isascii()
        and (type(ttl) is float or type(ttl) is int)
        and 0 < ttl <= MAX_TTL
        and timeout is None
        and blocking is True
        and max_hold is None
    ):
        return name, float(ttl), None, True, None
    name = check_name(name)
    ttl_f = check_lease_ttl(ttl)
    timeout_f = check_timeout(timeout)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, not {type(blocking).__name__}")
    if not blocking and timeout_f is not None:
        raise ValueError("timeout only applies to blocking=True; pass one or the other")
    hold = None if max_hold is None else check_ttl(max_hold, what="max_hold")
    return name, ttl_f, timeout_f, blocking, hold


def _refuse_nested(backend: Backend, name: str, holds: tuple[Any, ...], task: object) -> None:
    """Raise :class:`AlreadyHeld` if this task is inside ``async with backend.lock(name)``.

    A child task starts with a copy of its parent's holds, so a hold counts only while
    its lease is live and only in the task that entered it.
    """
    for _, lease, _ in holds:
        if (
            lease.name == name
            and lease._backend is backend
            and lease._task == task  # tasks compare by identity; a fallback id by value
            and task is not None
            and not lease._released
            and not lease.lost
        ):
            raise AlreadyHeld(name, lease.token)


class Lock:
    """``async with backend.lock(name, ttl=...) as lease:`` — see :meth:`Backend.lock`.

    Reusable and safe to share: each entering task gets its own lease (ownership lives on
    the lease, per task; never in thread-locals).
    """

    __slots__ = ("_args", "_backend", "_token_scope")

    def __init__(
        self,
        backend: Backend,
        name: str,
        *,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        token_scope: str | None = None,
    ) -> None:
        self._backend = backend
        self._args = _check_lock_args(name, ttl, timeout, blocking, max_hold)
        self._token_scope = None if token_scope is None else _check_scope(token_scope)

    @property
    def name(self) -> str:
        return self._args[0]

    def __repr__(self) -> str:
        return f"<asynclock.Lock {self.name!r} ttl={self._args[1]:g}>"

    async def __aenter__(self) -> Lease:
        backend = self._backend
        task = backend._current_task()  # None: not on the loop that opened the backend
        if task is None and backend._open:
            backend._wrong_loop()
        holds = _HOLDS.get()
        if holds:
            _refuse_nested(backend, self._args[0], holds, task)
        if self._token_scope is None:
            lease = await backend._acquire(*self._args)
        else:
            lease = await backend._acquire(*self._args, token_scope=self._token_scope)
        lease._task = task
        scope = backend._scope_type()
        scope.__enter__()
        lease._scope = scope
        if lease.lost.reason is not None:
            scope.cancel()
        _HOLDS.set((*holds, (self, lease, scope)))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        holds = _HOLDS.get()
        if holds[-1][0] is self:  # the usual case: the innermost hold
            _, lease, scope = holds[-1]
            _HOLDS.set(holds[:-1])
        else:
            index = max(i for i, hold in enumerate(holds) if hold[0] is self)
            _, lease, scope = holds[index]
            _HOLDS.set(holds[:index] + holds[index + 1 :])
        lease._scope = None
        lease._task = None  # the hold is over (and a kept lease must not keep its task)
        assert scope is not None  # a Lock's own entry always carries its scope
        if scope.cancel_called:
            # Lost (or cancelled from inside): leave the cancelled scope, then release in
            # a fresh shielded one.
            try:
                swallowed = bool(scope.__exit__(exc_type, exc, tb))
            finally:
                await self._backend._release(lease, quiet=True)
        else:
            # The usual case: release inside the holder's own scope, shielded from outer
            # cancellation from here on — one cancel scope per hold, not two. Nothing can
            # cancel this scope now but the release deadline: the lease left the renewer
            # and watchdog (`_held`) first thing in `_release`, and `_scope` is unset.
            scope.shield = True
            try:
                await self._backend._release(lease, quiet=True, scope=scope)
            finally:
                swallowed = bool(scope.__exit__(exc_type, exc, tb))
        if lease.lost.reason is not None:
            if swallowed or exc_type is None:
                reason = lease.lost.reason or "lost"
                raise LeaseLost(lease.name, lease.token, reason) from None
            return False
        return swallowed
