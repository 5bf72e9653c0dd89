"""The release of a lease at the server (G5, G6), the second half of a hold's path through
the core (``acquisition.py`` is the first): shielded and bounded, local state changed only
after the server confirms, and the hold's bookkeeping handed to the session."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, NoReturn

import anyio

from .bounds import ArmOnSuspend, CallBounds, shielded_call
from .clock import Clock
from .context import ExcInfo, lost_on_exit
from .driver import Driver
from .exceptions import BackendUnavailable
from .fastpath import _level_cache
from .lease import Lease, deadline_reason
from .session import Session

if TYPE_CHECKING:
    from .stats import StatsRecorder

logger = logging.getLogger("asynclock")
#: ``logger.isEnabledFor``'s answer for a level, if known (see fastpath._level_cache).
_known_level = _level_cache(logger).get
_DEBUG = logging.DEBUG
_get_ident = threading.get_ident


class Releasing:
    """The release half of :class:`~.acquisition.Acquisition` (a mixin: its state is the
    acquisition's)."""

    driver: Driver
    session: Session
    clock: Clock
    bounds: CallBounds
    stats: StatsRecorder
    _thread: int | None
    _remote: bool

    def wrong_loop(self) -> NoReturn:
        raise NotImplementedError

    async def release(
        self,
        lease: Lease,
        quiet: bool = False,
        scope: anyio.CancelScope | None = None,
        exiting: ExcInfo | None = None,
    ) -> bool:
        """Release ``lease`` at the server (G6). True if released; False if it was lost or
        released already (a reported no-op) or, with ``quiet``, if the server did not
        confirm (else BackendUnavailable).

        ``scope``: a shielded cancel scope the caller is inside and owns (the holder's own
        scope, shield turned on after the body); the release then runs in it instead of a
        new one, and its deadline bounds the call.

        ``exiting``: ``Lock.__aexit__``'s arguments, for a lock whose holder scope is
        ``scope``: the release ends by leaving ``scope`` with them (whatever happens) and
        returns what ``__aexit__`` returns, or raises :class:`LeaseLost` for a lost lease.
        ``Lock.__aexit__`` returns this coroutine instead of awaiting it in one of its own:
        a coroutine layer less per hold.
        """
        released = False
        try:
            # (A lock exits in the task that entered it: on the right loop, checked then.)
            if exiting is None and _get_ident() != self._thread:
                self.wrong_loop()
            session = self.session
            # Stop renewing first: renewal is tied to the holder's life, never outlives it.
            # (Session.drop, inline.)
            try:  # noqa: SIM105 (suppress() costs a context manager per hold)
                del session.held[lease.owner]
            except KeyError:
                pass  # lost (or let expire): dropped already
            if session.extends:
                session.drop(lease)
            if not lease._released:
                now = self.clock.now()
                if session.observer is not None:
                    session.observer.released(lease, now - lease.acquired_at)
                # Past lease.deadline (the loop was blocked, the watchdog never ran): lost.
                if (
                    now >= lease._deadline
                    or (lease.hard_deadline is not None and now >= lease.hard_deadline)
                ) and lease.lost.reason is None:
                    session.lose(lease, deadline_reason(lease, now))
                was_lost = lease.lost.reason is not None
                error: BaseException | None = None
                call = lease._keeper.release(lease.name, lease.owner, lease.token)
                try:
                    if scope is None:
                        ok = await shielded_call(call, self.bounds)
                    elif self._remote:  # it will suspend: arm at once, no trampoline per resume
                        bounds = self.bounds
                        bounds.inflight[scope] = now + bounds.timeout  # bounds.arm(), inline
                        if bounds.parked is not None:
                            bounds.unpark()
                        try:
                            ok = await call
                        finally:
                            bounds.inflight.pop(scope, None)
                    else:
                        # Run the call up to its first suspension right here: most releases
                        # (SQLite, memory) finish without one and need no timer at all.
                        try:
                            first = call.send(None)
                        except StopIteration as done:
                            ok = done.value
                        else:
                            ok = await ArmOnSuspend(call, scope, self.bounds, first)
                except Exception as exc:
                    ok, error = None, exc
                except anyio.get_cancelled_exc_class():
                    if scope is None or not scope.cancel_called:
                        raise
                    ok = None
                    # Our own deadline (release_timeout) fired: report it as a timeout
                    # (below); the scope is left next, with no await in between.
                if ok and not was_lost:  # the usual case
                    session.finish(lease, now)
                    released = True
                    if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):
                        logger.debug("released %r token=%d", lease.name, lease.token)
                else:
                    self._not_released(lease, ok, error, now, was_lost, quiet)
        finally:
            if exiting is not None:
                assert scope is not None
                swallowed = scope.__exit__(*exiting)
        if exiting is None:
            return released
        if not released and lease.lost.reason is not None:
            return lost_on_exit(lease, swallowed, exiting[0])
        return swallowed

    def _not_released(
        self,
        lease: Lease,
        ok: bool | None,
        error: BaseException | None,
        now: float,
        was_lost: bool,
        quiet: bool,
    ) -> None:
        """The release's answer, when it was not a plain "released" (see :meth:`release`)."""
        if ok is None:
            # Unconfirmed: keep the lease as it is so `release()` can be retried; renewal
            # has stopped, so the server lets it expire within its ttl either way.
            why = f"release failed: {error!r}" if error else "release timed out"
            why += f"; the server expires it within its ttl ({lease.ttl:g}s)"
            if quiet or was_lost:
                self.session.release_failed(lease, why)
                return
            raise BackendUnavailable(f"{self.driver.display}: {why}") from error
        if ok:
            # Lost locally (deadline) but still ours at the server: freed early, still lost.
            self.session.finish(lease, now, released=False)
            return
        self.stats.hold_times.append(now - lease.acquired_at)
        if not was_lost:
            self.session.lose(lease, "lease had already ended at the server when released")
        logger.info(
            "release of %r token=%d was a no-op: lease already lost", lease.name, lease.token
        )
