"""The one way in for leases granted outside ``acquire``: the hook every other kind of hold
stands on (claimed rows, semaphore permits, partitions, ...).

A feature whose server grants leases in a step of its own (a claim statement that locks a
batch of rows, a permit script) gets a :class:`Holds` from the backend, for its own
:class:`~.driver.Keeper` (the server calls that renew and give back its leases), and:

* :meth:`Holds.adopt` — hands a granted lease to the session: renewed with the keeper's
  ``extend`` in the session's rounds, watched against its local deadline, lost through
  ``Session.lose`` (its holder cancelled), counted in ``stats()``, told to observers
  (OpenTelemetry, advice) and reachable by ``asynclock.testing.force_loss``;
* :meth:`Holds.enter` / :meth:`Holds.exit` — the body of a hold, as ``async with`` on a
  lock has it (``context.enter_body``): a lease lost or past its deadline raises
  ``LeaseLost`` before any of the body runs; a loss cancels the body and the exit raises;
* :meth:`Holds.end` — a server call that ends the hold (complete, fail): the lease leaves
  renewal first (a renewal after the call would find it gone and cancel work that just
  finished), the call runs shielded and bounded; if the server refused the statement (the
  lease is still ours) the lease is renewed again; then :meth:`Holds.finish` (counted as
  released, its hold time recorded) or :meth:`Holds.lose`;
* ``lease.release()`` on an adopted lease gives it back through the keeper (owner-checked).

The feature keeps its storage and its own state; it never writes a lease's fields.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .bounds import CallBounds
from .clock import Clock
from .context import (
    LEASES,
    ExcInfo,
    enter_body,
    enter_group,
    leave_body,
    leave_group,
    lost_on_exit,
)
from .exceptions import BackendUnavailable
from .keeper import Keeper
from .lease import Lease, LossSignal, deadline_reason

if TYPE_CHECKING:
    from .acquisition import Acquisition

T = TypeVar("T")


class Holds:
    """The session's hook for one kind of hold (see the module). Made by the backend
    (``Backend.claims`` and the like pass one to the driver's feature); cheap."""

    def __init__(self, acq: Acquisition, keeper: Keeper, kind: str) -> None:
        self._acq = acq
        self._session = acq.session
        #: The server side of this kind of hold.
        self.keeper = keeper
        #: What these holds are ("claim", "permit"), for messages.
        self.kind = kind
        #: The backend's clock (an attribute: every hold's body reads it on entry).
        self.clock: Clock = acq.clock

    def __repr__(self) -> str:
        return f"<Holds {self.kind} on {self.keeper.display}>"

    # -- what the feature needs -------------------------------------------------------------

    @property
    def bounds(self) -> CallBounds:
        """The bound (``release_timeout``) every shielded clean-up call shares."""
        return self._acq.bounds

    @property
    def min_ttl(self) -> float:
        """A ttl at or below this leaves no time after drift and margin."""
        return self._session.min_ttl

    def ttl_error(self, ttl: float) -> ValueError:
        return self._session.ttl_error(ttl)

    def ready(self) -> None:
        """Raise unless the backend is open and this runs on its event loop."""
        self._acq.ready()

    def check_loop(self) -> None:
        self._acq.check_loop()

    def current_task(self) -> object:
        return self._acq.current_task()

    def new_owner(self) -> str:
        """A fresh owner id, unique per hold (as every acquisition's)."""
        return self._acq.new_owner()

    def adopt(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        t_send: float,
        max_hold: float | None = None,
    ) -> Lease:
        """The lease the keeper's server granted to a request sent at ``t_send``, renewed
        from now on (see the module)."""
        session = self._session
        lease = session.new_lease(name, owner, token, ttl, t_send, max_hold, self, self.keeper)
        session.adopt(lease)
        return lease

    async def acquire(
        self,
        name: str,
        ttl: float,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> Lease:
        """For a keeper that grants by name with a wait queue (a
        :class:`~.keeper.Grants`: a semaphore's permits, a read-write lock's modes): the
        lease for ``name``, acquired and waited for exactly as a lock is (busy with
        ``blocking=False``: LockHeld; ``timeout``: AcquireTimeout; an interrupted attempt
        cleaned up, G6), then renewed by the session through the keeper. Arguments are the
        caller's to check (``validation.check_lock_args``). ``lease.release()`` gives it
        back through the keeper."""
        keeper = self.keeper
        assert hasattr(keeper, "acquire"), f"{keeper!r} grants nothing by name"
        return await self._acq.acquire(
            name,
            ttl,
            timeout,
            blocking,
            max_hold,
            via=keeper,  # type: ignore[arg-type]
        )

    async def shielded(self, call: Coroutine[Any, Any, T]) -> T | None:
        """Run ``call`` shielded from cancellation and bounded by :attr:`bounds` (None: no
        answer in time), with the backend's cheap scope and no event-loop timer per call.
        Armed up front, not on the first suspension (``ArmOnSuspend``): a hold's server
        call always suspends, and relaying each suspension through a Python generator
        cost a claimed row about 20 k instructions (two calls)."""
        acq = self._acq
        bounds = acq.bounds
        scope = acq._new_scope(acq.scope_type)  # fastpath.new_scope(), inline
        scope.__init__(shield=True)
        with scope:
            bounds.arm(scope)
            try:
                return await call
            finally:
                bounds.inflight.pop(scope, None)
        return None  # no answer within the bound: the scope was cancelled

    async def checkpoint_if_cancelled(self) -> None:
        """Raise the caller's cancellation, if any, without yielding (the backend's own
        lookup of ``anyio.lowlevel.checkpoint_if_cancelled``)."""
        await self._acq._checkpoint_if_cancelled()

    # -- the body of a hold -----------------------------------------------------------------

    def enter(self, pusher: object, lease: Lease) -> None:
        """Begin ``pusher``'s body holding ``lease`` (raises LeaseLost, the body never
        runs, if the lease is lost or past its local deadline: the session loses it)."""
        acq = self._acq
        acq.check_loop()
        scope = acq._new_scope(acq.scope_type)  # fastpath.new_scope(), inline
        scope.__init__()
        try:
            enter_body(pusher, lease, acq.current_task(), scope, LEASES.get())
        except BaseException:
            if lease.lost.reason is None and not lease.released:
                self._session.lose(lease, deadline_reason(lease, self.clock.now()))
            raise

    def enter_all(self, pusher: object, leases: Sequence[Lease]) -> None:
        """:meth:`enter` for one body holding several leases (all or nothing): one holder
        scope, cancelled by the loss of any one of them."""
        self._acq.check_loop()
        enter_group(pusher, leases, self._acq.current_task(), anyio.CancelScope(), LEASES.get())

    def exit_all(self, pusher: object, exc_info: ExcInfo) -> bool:
        """:meth:`exit` for :meth:`enter_all`: raises LeaseLost if any lease was lost."""
        leases, scope = leave_group(pusher)
        assert scope is not None
        swallowed = bool(scope.__exit__(*exc_info))
        lost = next((lease for lease in leases if lease.lost.reason is not None), None)
        if lost is not None:
            return lost_on_exit(lost, swallowed, exc_info[0])
        return swallowed

    def exit(self, pusher: object, exc_info: ExcInfo, *, ended: bool) -> bool:
        """End ``pusher``'s body: what ``__aexit__`` returns (True: the exception was the
        loss's cancellation, swallowed). Raises LeaseLost when the lease was lost and the
        hold did not end at the server first (``ended``: completed or given back)."""
        _, lease, scope = leave_body(pusher)
        assert scope is not None
        swallowed = bool(scope.__exit__(*exc_info))
        if lease.lost.reason is not None and not ended:
            return lost_on_exit(lease, swallowed, exc_info[0])
        return swallowed

    # -- the end of a hold ------------------------------------------------------------------

    async def end(self, lease: Lease, call: Coroutine[Any, Any, T]) -> T | None:
        """Run ``call`` (a server step that ends ``lease``'s hold: complete, fail) shielded
        and bounded (None: no answer in time), with the lease out of renewal. Then the
        caller :meth:`finish` es the lease or :meth:`lose` s it, as the answer says. If the
        call raises an error of the server's own (it refused the statement: nothing was
        written, the lease is still ours), the lease is renewed again and the error
        propagates unchanged; ``BackendUnavailable`` (unknown outcome) leaves it out of
        renewal, for the caller to lose."""
        return await self.end_many((lease,), call)

    async def end_many(self, leases: Sequence[Lease], call: Coroutine[Any, Any, T]) -> T | None:
        """:meth:`end` for one server step that ends many leases' holds at once (a batch
        of claims' completions): every lease out of renewal while it runs, renewed again
        if the server refused the step."""
        session = self._session
        for lease in leases:
            session.drop(lease, "ending")
        try:
            return await self.shielded(call)
        except BackendUnavailable:
            raise
        except Exception:
            for lease in leases:
                session.renew_again(lease)
            raise

    def finish(self, lease: Lease) -> None:
        """``lease``'s hold ended at the server (completed, failed, given back): counted as
        a release, its hold time recorded, observers told."""
        session = self._session
        session.drop(lease)
        now = self.clock.now()
        if session.observer is not None:
            session.observer.released(lease, now - lease.acquired_at)
        if not lease.released:
            session.finish(lease, now, released=lease.lost.reason is None)

    def lose(self, lease: Lease, reason: str) -> None:
        """``lease`` is no longer ours (the server said so): lost, its holder cancelled."""
        self._session.lose(lease, reason)

    # -- lease.Grantor: what a lease's own methods go through --------------------------------

    async def release(self, lease: Lease, *, quiet: bool = False) -> bool:
        return await self._acq.release(lease, quiet)

    async def let_expire(self, lease: Lease) -> bool:
        return await self._session.let_expire(lease)

    async def extend(self, lease: Lease, ttl: object) -> None:
        await self._session.extend(lease, ttl)


class LeaseHeld:
    """What a hold made of one lease (a permit, a read-write hold) shows of that lease:
    :attr:`lost`, :attr:`released`, :meth:`remaining`, :meth:`check`. Subclasses set
    ``lease``."""

    __slots__ = ()
    lease: Lease

    @property
    def lost(self) -> LossSignal:
        """Set (with a reason) once the hold is lost; ``await hold.lost`` waits for it."""
        return self.lease.lost

    @property
    def released(self) -> bool:
        return self.lease.released

    def remaining(self) -> float:
        """Seconds until the local deadline (0 once lost or released)."""
        return self.lease.remaining()

    def check(self) -> None:
        """Raise :class:`~asynclock.LeaseLost` if the hold is lost or past its deadline."""
        self.lease.check()
