"""The session: the life of every lease a backend holds (etcd's ``concurrency.Session``).

One per backend (so per event loop). It owns, and nothing else touches (the table of who
writes each field of a lease is in ``lease.py``):

* the making of every lease (:meth:`Session.new_lease`, the only constructor) and its
  local deadline, from one formula (:meth:`Session.deadline`, G3);
* the leases it renews (:attr:`Session.held`), whatever kind of hold each one is: a lock
  granted by ``acquire`` (:meth:`Session.grant`), or a lease a feature's own server step
  granted (a claimed row, a permit) and handed over with :meth:`Session.adopt` — each with
  the :class:`~.driver.Keeper` that renews and releases it;
* the heartbeat (``renewer.py``): leases renewed at their own cadence, in chunks, most
  urgent first, and a renewer that falls behind says so before a deadline passes (G7);
* the watchdog, which cancels a holder whose local deadline or ``max_hold`` passes (G4);
* the end of a hold: loss (:meth:`Session.lose`, the one place a loss happens) and
  release (:meth:`Session.finish`), ``lease.extend(ttl)`` and ``lease.let_expire()``;
* leases dropped unreleased (garbage-collected): released, with a warning.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .bounds import CallBounds, cleanup, shielded_call
from .clock import Clock
from .exceptions import BackendUnavailable, LeaseLost
from .fastpath import _level_cache
from .keeper import Keeper, LeaseRef, Refused
from .lease import Lease, LossSignal, deadline_reason
from .observer import Observer
from .renewer import IDLE_NAP, ExtendRequest, Renewer
from .stats import ReleaseStorm, StatsRecorder, loss_kind
from .validation import check_lease_ttl, no_time_left

if TYPE_CHECKING:
    from .lease import Grantor

logger = logging.getLogger("asynclock")
#: ``logger.isEnabledFor``'s answer for a level, if known (see fastpath._level_cache).
_known_level = _level_cache(logger).get
_ref = weakref.ref
_DEBUG = logging.DEBUG

_new = object.__new__

#: What the session keeps per held lease: a weak reference (the holder keeps the Lease
#: alive), its name and token (to release it once it is collected), and the keeper that
#: renews and releases it. A plain tuple: made once per hold.
HeldRecord = tuple["weakref.ref[Lease]", str, int, Keeper]


class Session:
    """Leases, heartbeat, watchdog, loss and ttl changes of every hold of one backend."""

    def __init__(
        self,
        clock: Clock,
        bounds: CallBounds,
        stats: StatsRecorder,
        drift: float,
        margin: float,
        heartbeat: float,
        display: str,
    ) -> None:
        self.clock = clock
        self.bounds = bounds
        self.stats = stats
        self.drift = drift
        self.margin = margin
        self.heartbeat = heartbeat
        #: The backend's driver's ``display``, for messages.
        self.display = display
        self.keep = 1 - drift
        #: A ttl at or below this leaves no time after drift and margin.
        self.min_ttl = margin / self.keep
        #: Called with a name once a lease of it was released here (local waiters may try
        #: again); the acquisition sets it.
        self.wake: Callable[[str], None] = lambda name: None
        #: The names local waiters wait for (the acquisition sets it, with :attr:`wake`):
        #: no waiter, no wake-up to make (most releases).
        self.waiting: Mapping[str, object] = {}
        #: owner -> (weak reference to the Lease, name, token, its keeper), for every lease
        #: renewed.
        self.held: dict[str, HeldRecord] = {}
        self.dropped: list[weakref.ref[Lease]] = []  # appended by the weakref callback
        self._on_collected = self.dropped.append
        #: ``lease.extend(ttl)`` requests for the renewer's next round, by owner.
        self.extends: dict[str, ExtendRequest] = {}
        self._watch_wake: anyio.CancelScope | None = None
        self._watch_until: float = -math.inf  # what the watchdog sleeps until, if it sleeps
        #: Work other threads left for the loop (``Acquisition.thread_acquire``): run at
        #: the renewer's next wake-up, which comes within IDLE_NAP once it is used, or at
        #: once when posted with a wake-up (see :meth:`run_inbox`).
        self.inbox: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self.inbox_used = False
        #: Told of grants, releases, losses and renewal rounds (``Backend.add_observer``);
        #: None: nobody is (every call site tests this one attribute first).
        self.observer: Observer | None = None
        self.renewer = Renewer(self)
        # Release failures in a storm (release_failed): counted, then summed up.
        self.release_storm = ReleaseStorm(logger)

    # -- deadlines and the making of leases ------------------------------------------------

    def deadline(self, t_send: float, ttl: float) -> float:
        """The local deadline of a lease asked for (or extended) at ``t_send`` (G3): earlier
        than the earliest moment the server could hand the name to someone else."""
        return t_send + ttl * self.keep - self.margin

    def ttl_error(self, ttl: float) -> ValueError:
        """The error for a ttl at or below :attr:`min_ttl`."""
        return no_time_left("ttl", ttl, self.drift, self.margin)

    def new_lease(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        t_send: float,
        max_hold: float | None,
        grantor: Grantor,
        keeper: Keeper,
    ) -> Lease:
        """The lease the server granted to a request sent at ``t_send``, not yet renewed
        (:meth:`adopt` it). The only constructor of a Lease; safe on any thread (it touches
        no state of the session)."""
        lease = _new(Lease)
        lease.name = name
        lease.owner = owner
        lease.token = token
        lease.ttl = ttl
        lease.acquired_at = t_send
        lease.hard_deadline = None if max_hold is None else t_send + max_hold
        lease.lost = lost = _new(LossSignal)
        lost._event = lost.reason = None
        lease._deadline = t_send + ttl * self.keep - self.margin  # self.deadline(), inline
        lease._grantor = grantor
        lease._keeper = keeper
        lease._scope = None
        lease._task = None
        lease._released = False
        return lease

    def grant(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        t_send: float,
        max_hold: float | None,
        grantor: Grantor,
        keeper: Keeper,
    ) -> Lease:
        """A lease ``acquire`` was granted, renewed from now on: :meth:`new_lease` and
        :meth:`adopt` in one, written out inline (the hold's fast path: a call less)."""
        deadline = t_send + ttl * self.keep - self.margin  # self.deadline(), inline
        lease = _new(Lease)  # new_lease(), inline: every field, as there
        lease.name = name
        lease.owner = owner
        lease.token = token
        lease.ttl = ttl
        lease.acquired_at = t_send
        lease.hard_deadline = None if max_hold is None else t_send + max_hold
        lease.lost = lost = _new(LossSignal)
        lost._event = lost.reason = None
        lease._deadline = deadline
        lease._grantor = grantor
        lease._keeper = keeper
        lease._scope = None
        lease._task = None
        lease._released = False
        self.held[owner] = (_ref(lease, self._on_collected), name, token, keeper)
        self.stats.acquired += 1
        if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):
            logger.debug("acquired %r token=%d ttl=%gs", name, token, ttl)
        renewer = self.renewer
        if t_send + ttl * self.heartbeat < renewer.next_round:  # due before the next round
            renewer.wake_at(t_send + ttl * self.heartbeat)
        if deadline < self._watch_until or (
            max_hold is not None and t_send + max_hold < self._watch_until
        ):
            _poke(self._watch_wake)
        return lease

    def adopt(self, lease: Lease) -> None:
        """Renew ``lease`` from now on: the one way in for a lease granted outside
        ``acquire`` (another thread's blocking call, a claimed row, a permit). Its keeper
        renews it; it is lost, counted, timed and observed as a lock is."""
        self.held[lease.owner] = (
            _ref(lease, self._on_collected),
            lease.name,
            lease.token,
            lease._keeper,
        )
        self.stats.acquired += 1
        if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):
            logger.debug("acquired %r token=%d ttl=%gs", lease.name, lease.token, lease.ttl)
        first_renewal = lease.acquired_at + lease.ttl * self.heartbeat
        if first_renewal < self.renewer.next_round:
            self.renewer.wake_at(first_renewal)
        if lease.deadline < self._watch_until:
            _poke(self._watch_wake)
        if self.observer is not None:
            self.observer.adopted(lease)

    def run_inbox(self) -> None:
        """On the loop: run what other threads left in :attr:`inbox`, oldest first."""
        inbox = self.inbox
        while inbox:
            func, args = inbox.popleft()
            func(*args)

    # -- the end of a hold -----------------------------------------------------------------

    def drop(self, lease: Lease, why: str = "released") -> None:
        """Stop renewing ``lease`` (before it is released, or once it is lost)."""
        self.held.pop(lease.owner, None)
        if self.extends:
            self.renewer.end_extend(lease, Refused(why))

    def renew_again(self, lease: Lease) -> None:
        """Renew ``lease`` again after :meth:`drop` (a hold's end the server refused, e.g. a
        claim's completion the database rejected: the claim is still ours)."""
        if lease.lost.reason is None and not lease._released and lease.owner not in self.held:
            self.held[lease.owner] = (
                _ref(lease, self._on_collected),
                lease.name,
                lease.token,
                lease._keeper,
            )
            self.renewer.wake_at(self.clock.now())
            if lease.deadline < self._watch_until:
                _poke(self._watch_wake)

    def finish(self, lease: Lease, now: float, *, released: bool = True) -> None:
        """``lease`` has ended at the server (released, completed, given back); ``now`` is
        when its release began. ``released``: count it as a release (False: it was lost
        first and is counted as that)."""
        lease._released = True
        self.stats.hold_times.append(now - lease.acquired_at)
        if released:
            self.stats.released += 1
        if self.waiting and not lease._keeper.wakes_waiters:
            self.wake(lease.name)

    def release_failed(self, lease: Lease, why: str) -> None:
        """A release the server did not confirm (renewal has stopped: the server expires the
        lease within its ttl): see :class:`~.stats.ReleaseStorm`."""
        self.release_storm.failed(f"{lease.name!r} token={lease.token}: {why}", self.clock.now())

    def flush_release_failures(self) -> None:
        self.release_storm.flush()

    def released_locally(self, lease: Lease) -> None:
        """Mark ``lease`` released before its release is confirmed (another thread's
        blocking release: the renewer and watchdog skip it from now on)."""
        lease._released = True

    def live(self) -> list[Lease]:
        """Every lease renewed here (and not yet garbage-collected)."""
        return [lease for ref, _, _, _ in list(self.held.values()) if (lease := ref()) is not None]

    def lose(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` lost (once), stop renewing it and cancel its holder (G4)."""
        self.drop(lease, reason)
        if lease.lost:
            return
        # The holder first (G4): nothing told of the loss below (a hook of the lease's
        # own, an observer: user code) can keep the body running by raising, nor stop the
        # caller's loop over other leases (a renewal round, a driver's session loss).
        if lease._scope is not None:
            lease._scope.cancel()
        self.stats.losses += 1
        self.stats.loss_reasons[loss_kind(reason)] += 1
        logger.warning("lease lost: %r token=%d: %s", lease.name, lease.token, reason)
        try:
            lease.lost._set(reason)
        except Exception:
            logger.exception("a hook on the loss of %r raised (the lease is lost)", lease.name)
        if self.observer is not None:
            try:
                self.observer.lost(lease, reason)
            except Exception:
                logger.exception("an observer's lost() raised for %r (ignored)", lease.name)

    def lose_name(self, name: str, reason: str) -> None:
        """Lose every lease of ``name`` held here (its lock was broken)."""
        for lease in [lease for lease in self.live() if lease.name == name]:
            self.lose(lease, reason)

    def lost_out_of_band(self, name: str, owner: str, reason: str) -> None:
        """The driver's ``notify_lost``: a lease is known lost outside a renewal round."""
        entry = self.held.get(owner)
        lease = None if entry is None else entry[0]()
        if lease is not None and lease.name == name:
            self.lose(lease, reason)

    def renew_soon(self) -> None:
        """The driver's ``renew_now``: renew every held lease now, not at its next
        heartbeat (a connection came back; the server may have restarted and lost them)."""
        self.renewer.renew_all_now()

    async def next_round(self) -> None:
        """Wait until the renewer finishes its next round (for tests and tools)."""
        await self.renewer.next_round_done()

    # -- ttl changes -----------------------------------------------------------------------

    async def let_expire(self, lease: Lease) -> bool:
        """Extend ``lease`` once more (owner-checked, G5), then stop renewing it."""
        entry = self.held.get(lease.owner)
        if entry is None or entry[0]() is not lease or lease._released:
            return False
        ref = LeaseRef(lease.name, lease.owner, lease.token, lease.ttl)
        result: object = None
        try:
            results = await shielded_call(lease._keeper.extend([ref]), self.bounds)
            result = None if results is None else results[0]
        except Exception as exc:
            result = exc
        if isinstance(result, Refused):
            self.lose(lease, f"renewal refused: {result.reason}")
            return False
        # Stop renewing; from here on only the server's ttl keeps the name taken.
        self.held.pop(lease.owner, None)
        lease._released = True
        self.stats.released += 1
        return result is True

    async def extend(self, lease: Lease, ttl: object) -> None:
        """``lease.extend(ttl)``: the renewer's next round, now, carries the new ttl."""
        new_ttl = check_lease_ttl(ttl)
        if new_ttl <= self.min_ttl:
            raise self.ttl_error(new_ttl)
        while True:
            lease.check()  # lost, released or past its deadline: LeaseLost, before any I/O
            entry = self.held.get(lease.owner)
            if entry is None or entry[0]() is not lease:
                raise LeaseLost(lease.name, lease.token, "no longer renewed by this backend")
            pending = self.extends.get(lease.owner)
            if pending is None:
                break
            await pending.done.wait()  # one ttl change at a time, in call order
        request = self.extends[lease.owner] = ExtendRequest(new_ttl)
        self.renewer.wake_at(self.clock.now())
        try:
            await request.done.wait()
        finally:
            if self.extends.get(lease.owner) is request:
                del self.extends[lease.owner]  # cancelled before the renewer sent it
            request.done.set()  # an extend queued behind this one may go now
        result = request.result
        if result is True:
            return
        if lease.lost.reason is not None:
            raise LeaseLost(lease.name, lease.token, lease.lost.reason)
        if isinstance(result, Refused):
            raise LeaseLost(lease.name, lease.token, result.reason)
        raise BackendUnavailable(
            f"{self.display}: extend of {lease.name!r} to ttl={new_ttl:g}s failed "
            f"(the lease keeps renewing with ttl={lease.ttl:g}s): {result!r}"
        ) from (result if isinstance(result, BaseException) else None)

    def extended(self, lease: Lease, ref: LeaseRef, result: object, t_send: float) -> None:
        """Apply the answer to ``lease.extend(ref.ttl)`` sent at ``t_send`` (G3, G4)."""
        deadline = self.deadline(t_send, ref.ttl)
        if result is True:
            lease.ttl = ref.ttl
            lease._deadline = deadline  # may move earlier: a shorter ttl
            self.stats.renewals += 1
        elif isinstance(result, Refused):
            self.lose(lease, f"extend refused: {result.reason}")
            return
        elif deadline < lease._deadline:
            # Unknown whether the server took the shorter ttl: assume it did.
            lease._deadline = deadline
        else:
            return
        if lease.deadline < self._watch_until:
            _poke(self._watch_wake)

    def apply_renewals(
        self,
        leases: list[Lease],
        refs: list[LeaseRef],
        results: Sequence[object],
        t_send: float,
        asked: dict[str, ExtendRequest] | None,
        round_trip: float,
        lag: float,
    ) -> int:
        """The answers of one renewal call sent at ``t_send`` (one per item, in order):
        deadlines moved (G3), refusals lost (G5), extends answered. Returns how many failed
        without a refusal (retried until their deadline, G7)."""
        stats = self.stats
        held = self.held
        renewed_before, lost_before = stats.renewals, stats.losses
        keep, margin = self.keep, self.margin
        errors = 0
        for lease, ref, result in zip(leases, refs, results, strict=True):
            request = asked.get(lease.owner) if asked else None
            entry = held.get(lease.owner)
            if entry is None or entry[0]() is not lease or lease._released:
                # Released or lost while we were asking (released by another thread: its
                # bookkeeping is not done here yet).
                if request is not None:
                    self.renewer.end_extend(
                        lease, Refused(lease.lost.reason or "released"), request
                    )
                continue
            if request is not None:
                self.extended(lease, ref, result, t_send)
                self.renewer.end_extend(lease, result, request)
                continue
            if result is True:
                deadline = t_send + lease.ttl * keep - margin  # self.deadline(), inline
                if deadline > lease._deadline:
                    lease._deadline = deadline
                stats.renewals += 1
            elif isinstance(result, Refused):
                self.lose(lease, f"renewal refused: {result.reason}")
            else:
                errors += 1
                logger.debug("renewal of %r failed, will retry: %r", lease.name, result)
        if errors:
            stats.renewal_errors += errors
        if self.observer is not None:
            self.observer.renewal_timing(round_trip, lag, leases)
            self.observer.renewal_round(
                stats.renewals - renewed_before, errors + stats.losses - lost_before
            )
        return errors

    # -- the background loops (started by the backend, cancelled when it closes) -----------

    async def renew_loop(self) -> None:
        await self.renewer.run()

    async def watchdog_loop(self) -> None:
        while True:
            now = self.clock.now()
            earliest = min(
                (lease.deadline for lease in self.live() if not lease._released),
                default=now + IDLE_NAP,
            )
            if now < earliest:
                self._watch_until = earliest
                with anyio.CancelScope() as scope:
                    self._watch_wake = scope
                    await self.clock.sleep_until(earliest)
                self._watch_wake = None
                self._watch_until = -math.inf
                continue
            for lease in self.live():
                if now >= lease.deadline and not lease._released:
                    self.lose(lease, deadline_reason(lease, now))

    async def reap_dropped(self) -> None:
        """Release the leases that were garbage-collected unreleased (nobody can use them,
        so nobody may keep the name), and say so like an unclosed file's ResourceWarning."""
        while self.dropped:  # drain first: a lease collected from now on flags again
            self.dropped.pop()
        for owner, entry in list(self.held.items()):
            if entry[0]() is not None or self.held.get(owner) is not entry:
                continue  # alive, or released while we were releasing another one
            del self.held[owner]
            _, name, token, keeper = entry
            logger.warning(
                "lease on %r (token %d) was garbage-collected without release(): releasing "
                "it; call `await lease.release()`, or hold it with `async with "
                "backend.lock(...)`",
                name,
                token,
            )
            await cleanup(keeper.release(name, owner, token), self.bounds, "release dropped")
            self.wake(name)

    def poke_watchdog(self, deadline: float) -> None:
        """A deadline moved earlier than what the watchdog sleeps until: wake it."""
        if deadline < self._watch_until:
            _poke(self._watch_wake)


def _poke(scope: anyio.CancelScope | None) -> None:
    if scope is not None:
        scope.cancel()
