"""Acquisition and release: one hold's whole path through the core.

* acquisition reads ``t_send`` before it asks and sets the local deadline to
  ``t_send + ttl * (1 - drift) - margin`` (G3);
* an interrupted acquire releases whatever the server may have granted, shielded and
  bounded; release on exit is shielded and bounded; local state changes only after the
  server confirms (G6).

:class:`Holding` is a part of :class:`~asynclock._core.backend.Backend` (a mixin over its
state), like the renewer; ``Lock`` (lock.py) enters and leaves the holder's scope around it.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn

import anyio

from .bounds import ArmOnSuspend, shielded_call
from .driver import Busy, Refused, watch_from
from .exceptions import (
    AcquireTimeout,
    AsynclockError,
    BackendUnavailable,
    LockHeld,
    RestartGrace,
)
from .lease import Lease
from .renewer import Renewer, _deadline_reason, _poke

logger = logging.getLogger("asynclock")
_get_ident = threading.get_ident

#: How long a waiter sleeps between attempts when the driver gives no hint.
DEFAULT_POLL = 0.05


class Holding(Renewer):
    """Acquire, wait, grant and release: the hold path of a :class:`Backend`."""

    # The backend's state this part reads and writes (set in Backend.__init__).
    _on_collected: Callable[[weakref.ref[Lease]], None]
    _owner_prefix: str
    _owner_seq: itertools.count[int]
    _release_events: dict[str, anyio.Event]
    _scope_type: type[anyio.CancelScope]
    _checkpoint_if_cancelled: Callable[[], Awaitable[None]]
    _open: bool
    _waiters: set[anyio.CancelScope]
    _pending: int
    _settled: anyio.Event | None
    _thread: int | None
    _current_task: Callable[[], object]
    _remote: bool

    if TYPE_CHECKING:

        def _require_open(self) -> None: ...
        def _wrong_loop(self) -> None: ...
        async def _call(self, what: str, call: Awaitable[object]) -> object: ...

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
        if not self._remote:  # else the attempt's own suspension is the checkpoint
            await self._checkpoint_if_cancelled()
        if ttl * (1 - self.drift) - self.margin <= 0:
            raise ValueError(
                f"ttl={ttl:g}s leaves no time after drift ({self.drift:.0%}) and margin "
                f"({self.margin:g}s); use a ttl of at least {2 * self.margin + 0.001:g}s"
            )
        # Unique per acquisition: 96 random bits per backend plus a counter (a syscall for
        # fresh randomness on every acquisition showed up in the fast path; %-formatting
        # is half the cost of an f-string with a format spec).
        owner = "%s%08x%s" % (self._owner_prefix, next(self._owner_seq), owner_tag)  # noqa: UP031
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
        watching, watched = False, result.cursor
        released: anyio.Event | None = None  # this backend's wake-up for ``name``
        scoped = {} if token_scope is None else {"scope": token_scope}  # older drivers: no scope
        # Cancelled when the backend closes: a waiter must not outlive its backend (nobody
        # would renew what it got).
        closing = self._scope_type()
        self._waiters.add(closing)
        try:
            with closing:
                while True:
                    self._stats.busy_attempts += 1
                    if not blocking:
                        raise _busy_error(name, result)
                    now = clock.now()
                    if give_up_at is not None and now >= give_up_at:
                        assert timeout is not None
                        raise AcquireTimeout(name, timeout, _timeout_detail(name, result))
                    # Woken while the attempt was on its way (listening began before it):
                    # its busy answer may predate the release, so try again at once. The
                    # first attempt's misses are the driver's to report (watch below).
                    if released is None:  # the first busy answer: listen from now on
                        released, retry_now = self._listen(name), False
                    else:
                        retry_now = released.is_set()  # then the one below is fresh
                    if not watching or result.cursor != watched:
                        # The first busy attempt, or one whose cursor moved (etcd: a new
                        # predecessor). The driver says whether a release may have been missed.
                        watching, watched = True, result.cursor
                        missed = await self._call("watch", watch_from(driver, name, watched))
                        retry_now = retry_now or bool(missed)
                    if not retry_now:
                        delay = DEFAULT_POLL if result.retry_after is None else result.retry_after
                        delay = delay * (1 + 0.1 * random.random()) + 0.0005 * random.random()
                        if give_up_at is not None:
                            delay = min(delay, give_up_at - now)
                        with anyio.move_on_after(max(0.0, delay)):
                            await released.wait()
                    released = self._listen(name)  # a fresh one if that one was set
                    t_send = clock.now()
                    try:
                        attempt = await driver.acquire(name, owner, ttl, queue=blocking, **scoped)
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

    def _listen(self, name: str) -> anyio.Event:
        """The event the next release or wake-up of ``name`` sets (one per name, shared by
        this backend's waiters; set and dropped by :meth:`_wake_waiters`)."""
        released = self._release_events.get(name)
        if released is None:
            released = self._release_events[name] = anyio.Event()
        return released

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
            elif self._remote:  # it will suspend: arm at once, no trampoline per resume
                bound = self._bounds.arm(scope)
                try:
                    ok = await call
                finally:
                    bound.scope = None
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


def _busy_error(name: str, busy: Busy) -> LockHeld:
    """What a busy answer raises for ``blocking=False``."""
    if busy.grace_until is not None:
        return RestartGrace(name, busy.retry_after or 0.0, busy.grace_until, busy.detail)
    return LockHeld(name, busy.retry_after, busy.detail)


def _timeout_detail(name: str, busy: Busy) -> str | None:
    """What :class:`AcquireTimeout` says of the last busy answer: only a restart grace is
    worth saying (a busy name is what a timeout means anyway)."""
    if busy.grace_until is None:
        return None
    message = str(_busy_error(name, busy))
    return "the backend was in its restart grace; " + message.split(", the end of ", 1)[0]
