"""The session: the life of every lease a backend holds (etcd's ``concurrency.Session``).

One per backend (so per event loop). It owns, and nothing else touches:

* the local deadline of every lease, from one formula (:meth:`Session.deadline`, G3; the
  grant, once per hold, writes it out inline);
* the heartbeat: one renewer extends *all* held leases in one driver call per interval and
  reports loss per lease (G7);
* the watchdog, which cancels a holder whose local deadline or ``max_hold`` passes (G4);
* loss (:meth:`Session.lose`), ``lease.extend(ttl)`` and ``lease.let_expire()``;
* leases dropped unreleased (garbage-collected): released, with a warning.

Acquisition (``acquisition.py``) hands it a granted lease with :meth:`Session.grant` and
takes a lease out of renewal with :meth:`Session.drop` before releasing it. The attributes
below without a leading underscore are that protocol; the rest is the session's own.
"""

from __future__ import annotations

import logging
import math
import random
import re
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .bounds import CallBounds, cleanup, shielded_call
from .clock import Clock
from .driver import Driver, LeaseRef, Refused
from .exceptions import BackendUnavailable, LeaseLost
from .fastpath import _level_cache
from .lease import Lease, LossSignal
from .observer import Observer
from .stats import StatsRecorder
from .validation import check_lease_ttl, no_time_left

if TYPE_CHECKING:
    from .lease import Grantor

logger = logging.getLogger("asynclock")
#: ``logger.isEnabledFor``'s answer for a level, if known (see fastpath._level_cache).
_known_level = _level_cache(logger).get
_ref = weakref.ref
_DEBUG = logging.DEBUG

_new = object.__new__

#: How long the idle renewer and watchdog sleep before looking again (no leases held).
IDLE_NAP = 1.0

#: What the session keeps per held lease: a weak reference (the holder keeps the Lease
#: alive), and the name and token to release it with once it is collected.
HeldRecord = tuple["weakref.ref[Lease]", str, int]


class Session:
    """Heartbeat, watchdog, loss and ttl changes of every lease of one backend."""

    def __init__(
        self,
        driver: Driver,
        clock: Clock,
        bounds: CallBounds,
        stats: StatsRecorder,
        drift: float,
        margin: float,
        heartbeat: float,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.bounds = bounds
        self.stats = stats
        self.drift = drift
        self.margin = margin
        self.heartbeat = heartbeat
        self._keep = 1 - drift
        #: A ttl at or below this leaves no time after drift and margin.
        self.min_ttl = margin / self._keep
        #: Called with a name once a dropped lease of it was released here (local waiters
        #: may try again); the acquisition sets it.
        self.wake: Callable[[str], None] = lambda name: None
        #: owner -> (weak reference to the Lease, name, token), for every lease renewed.
        self.held: dict[str, HeldRecord] = {}
        self._dropped: list[weakref.ref[Lease]] = []  # appended by the weakref callback
        self._on_collected = self._dropped.append
        #: ``lease.extend(ttl)`` requests for the renewer's next round, by owner.
        self.extends: dict[str, ExtendRequest] = {}
        self._renew_wake: anyio.CancelScope | None = None
        self._watch_wake: anyio.CancelScope | None = None
        self._next_round: float = math.inf
        self._renew_asap = False  # renew_soon() asked for a round after the current one
        self._watch_until: float = -math.inf  # what the watchdog sleeps until, if it sleeps
        self._round_done = anyio.Event()
        #: Work other threads left for the loop (``Acquisition.thread_acquire``): run at
        #: the renewer's next wake-up, which comes within IDLE_NAP once it is used, or at
        #: once when posted with a wake-up (see :meth:`run_inbox`).
        self.inbox: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self.inbox_used = False
        #: Told of losses and renewal rounds (``observer.observe``); None: nobody is.
        self.observer: Observer | None = None

    # -- the protocol: deadlines, grant, drop, loss ----------------------------------------

    def deadline(self, t_send: float, ttl: float) -> float:
        """The local deadline of a lease asked for (or extended) at ``t_send`` (G3): earlier
        than the earliest moment the server could hand the name to someone else."""
        return t_send + ttl * self._keep - self.margin

    def ttl_error(self, ttl: float) -> ValueError:
        """The error for a ttl at or below :attr:`min_ttl`."""
        return no_time_left("ttl", ttl, self.drift, self.margin)

    def grant(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        t_send: float,
        max_hold: float | None,
        grantor: Grantor,
    ) -> Lease:
        """The lease the server granted to a request sent at ``t_send``, renewed from now on."""
        deadline = t_send + ttl * self._keep - self.margin  # self.deadline(), inline
        hard = None if max_hold is None else t_send + max_hold
        # Every field of the Lease (see the class), set here: no __init__ calls per hold.
        lease = _new(Lease)
        lease.name = name
        lease.owner = owner
        lease.token = token
        lease.ttl = ttl
        lease.acquired_at = t_send
        lease.hard_deadline = hard
        lease.lost = lost = _new(LossSignal)
        lost._event = lost.reason = None
        lease._deadline = deadline
        lease._grantor = grantor
        lease._scope = None
        lease._task = None
        lease._released = False
        self.held[owner] = (_ref(lease, self._on_collected), name, token)
        self.stats.acquired += 1
        if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):
            logger.debug("acquired %r token=%d ttl=%gs", name, token, ttl)
        if t_send + ttl * self.heartbeat < self._next_round:  # renew it before the next round
            self._next_round = t_send + ttl * self.heartbeat
            _poke(self._renew_wake)
        if deadline < self._watch_until or (hard is not None and hard < self._watch_until):
            _poke(self._watch_wake)
        return lease

    def run_inbox(self) -> None:
        """On the loop: run what other threads left in :attr:`inbox`, oldest first."""
        inbox = self.inbox
        while inbox:
            func, args = inbox.popleft()
            func(*args)

    def new_lease(
        self, name: str, owner: str, token: int, ttl: float, t_send: float, grantor: Grantor
    ) -> Lease:
        """A lease granted to another thread (``Acquisition.thread_acquire``), not yet
        renewed: the loop :meth:`adopt` s it. Safe on any thread: it touches no state of
        the session. (:meth:`grant` fills the same fields inline, for speed.)"""
        lease = _new(Lease)
        lease.name = name
        lease.owner = owner
        lease.token = token
        lease.ttl = ttl
        lease.acquired_at = t_send
        lease.hard_deadline = None
        lease.lost = lost = _new(LossSignal)
        lost._event = lost.reason = None
        lease._deadline = t_send + ttl * self._keep - self.margin  # self.deadline()
        lease._grantor = grantor
        lease._scope = None
        lease._task = None
        lease._released = False
        return lease

    def adopt(self, lease: Lease) -> None:
        """Renew ``lease`` from now on: :meth:`grant`'s bookkeeping, for a lease another
        thread was granted (``Acquisition.thread_acquire``; this runs on the loop)."""
        self.held[lease.owner] = (_ref(lease, self._on_collected), lease.name, lease.token)
        self.stats.acquired += 1
        if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):
            logger.debug("acquired %r token=%d ttl=%gs", lease.name, lease.token, lease.ttl)
        first_renewal = lease.acquired_at + lease.ttl * self.heartbeat
        if first_renewal < self._next_round:
            self._next_round = first_renewal
            _poke(self._renew_wake)
        if lease.deadline < self._watch_until:
            _poke(self._watch_wake)

    def drop(self, lease: Lease, why: str = "released") -> None:
        """Stop renewing ``lease`` (before it is released, or once it is lost)."""
        self.held.pop(lease.owner, None)
        if self.extends:
            self._end_extend(lease, Refused(why))

    def live(self) -> list[Lease]:
        """Every lease renewed here (and not yet garbage-collected)."""
        return [lease for ref, _, _ in list(self.held.values()) if (lease := ref()) is not None]

    def lose(self, lease: Lease, reason: str) -> None:
        """Mark ``lease`` lost (once), stop renewing it and cancel its holder (G4)."""
        self.drop(lease, reason)
        if lease.lost:
            return
        lease.lost._set(reason)
        self.stats.losses += 1
        self.stats.loss_reasons[re.split(r"[:;(]", reason, maxsplit=1)[0].strip()] += 1
        logger.warning("lease lost: %r token=%d: %s", lease.name, lease.token, reason)
        if self.observer is not None:
            self.observer.lost(lease, reason)
        if lease._scope is not None:
            lease._scope.cancel()

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
        """The driver's ``renew_now``: renew every held lease now, not at the next heartbeat
        (a connection came back; the server may have restarted and lost them)."""
        self._renew_asap = True
        if self.held:
            self._next_round = self.clock.now()
            _poke(self._renew_wake)

    async def next_round(self) -> None:
        """Wait until the renewer finishes its next round trip (for tests and tools)."""
        await self._round_done.wait()

    # -- ttl changes -----------------------------------------------------------------------

    async def let_expire(self, lease: Lease) -> bool:
        """Extend ``lease`` once more (owner-checked, G5), then stop renewing it."""
        entry = self.held.get(lease.owner)
        if entry is None or entry[0]() is not lease or lease._released:
            return False
        ref = LeaseRef(lease.name, lease.owner, lease.token, lease.ttl)
        result: object = None
        try:
            results = await shielded_call(self.driver.extend([ref]), self.bounds)
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
        self._next_round = self.clock.now()
        _poke(self._renew_wake)
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
            f"{self.driver.display}: extend of {lease.name!r} to ttl={new_ttl:g}s failed "
            f"(the lease keeps renewing with ttl={lease.ttl:g}s): {result!r}"
        ) from (result if isinstance(result, BaseException) else None)

    # -- the background loops (started by the backend, cancelled when it closes) -----------

    async def renew_loop(self) -> None:
        failures = 0
        idle = IDLE_NAP
        while True:
            if not self.held and self._next_round <= self.clock.now():
                # Nap instead of parking at infinity: a grant within the nap then needs no
                # wake-up call (tight acquire/release loops stay cheap).
                self._next_round = self.clock.now() + idle
            wake_at = self._next_round
            if self.inbox_used:  # other threads leave work: look at least every IDLE_NAP
                wake_at = min(wake_at, self.clock.now() + IDLE_NAP)
            await self._sleep_until(wake_at, "_renew_wake")
            if self.inbox:
                self.run_inbox()
            if self._dropped:
                await self.reap_dropped()
                if not self.held:  # nothing left to renew: this was the round
                    self._round_done.set()
                    self._round_done = anyio.Event()
            if not self.held:
                continue
            now = self.clock.now()
            due = self._next_round
            if now < due:
                continue
            batch = self.live()
            if not batch:
                continue
            period = min(lease.ttl for lease in batch) * self.heartbeat
            idle = min(period, IDLE_NAP)
            refs = [LeaseRef(lease.name, lease.owner, lease.token, lease.ttl) for lease in batch]
            # lease.extend(ttl) requests ride this round with their new ttl (one renewer:
            # rounds never overlap, so the server's expiry is the last one we sent).
            asked = self._extends_for(refs) if self.extends else None
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
            round_trip = self.clock.now() - t_send  # (once per round, not per hold)
            self.stats.renewal_round_trips += 1
            errors = 0
            renewed_before, lost_before = self.stats.renewals, self.stats.losses
            for lease, ref, result in zip(batch, refs, results, strict=True):
                request = asked.get(lease.owner) if asked else None
                entry = self.held.get(lease.owner)
                if entry is None or entry[0]() is not lease or lease._released:
                    # (released: by another thread, its bookkeeping not done here yet)
                    if request is not None:
                        self._end_extend(lease, Refused(lease.lost.reason or "released"), request)
                    continue  # released or lost while we were asking
                if request is not None:
                    self._extended(lease, ref, result, t_send)
                    self._end_extend(lease, result, request)
                    continue
                if result is True:
                    deadline = self.deadline(t_send, lease.ttl)
                    if deadline > lease._deadline:
                        lease._deadline = deadline
                    self.stats.renewals += 1
                elif isinstance(result, Refused):
                    self.lose(lease, f"renewal refused: {result.reason}")
                else:
                    errors += 1
                    logger.debug("renewal of %r failed, will retry: %r", lease.name, result)
            if self.observer is not None:
                self.observer.renewal_timing(round_trip, now - due, batch)
                self.observer.renewal_round(
                    self.stats.renewals - renewed_before,
                    errors + self.stats.losses - lost_before,
                )
            self._round_done.set()
            self._round_done = anyio.Event()
            if errors:
                self.stats.renewal_errors += errors
                failures += 1
                backoff = min(period, 0.02 * 2 ** min(failures, 10)) * (0.5 + random.random() / 2)
                self._next_round = self.clock.now() + backoff
            else:
                failures = 0
                self._next_round = t_send + period
            if asked is not None or self.extends:
                # A ttl changed (the period with it), or an extend waits for a round.
                self._next_round = self._after_extends(t_send, errors > 0)
            if self._renew_asap:  # asked during this round: its answers may predate it
                self._next_round = self.clock.now()

    async def watchdog_loop(self) -> None:
        while True:
            now = self.clock.now()
            earliest = min(
                (lease.deadline for lease in self.live() if not lease._released),
                default=now + IDLE_NAP,
            )
            if now < earliest:
                self._watch_until = earliest
                await self._sleep_until(earliest, "_watch_wake")
                self._watch_until = -math.inf
                continue
            for lease in self.live():
                if now >= lease.deadline and not lease._released:
                    self.lose(lease, deadline_reason(lease, now))

    async def reap_dropped(self) -> None:
        """Release the leases that were garbage-collected unreleased (nobody can use them,
        so nobody may keep the name), and say so like an unclosed file's ResourceWarning."""
        while self._dropped:  # drain first: a lease collected from now on flags again
            self._dropped.pop()
        for owner, entry in list(self.held.items()):
            if entry[0]() is not None or self.held.get(owner) is not entry:
                continue  # alive, or released while we were releasing another one
            del self.held[owner]
            _, name, token = entry
            logger.warning(
                "lease on %r (token %d) was garbage-collected without release(): releasing "
                "it; call `await lease.release()`, or hold it with `async with "
                "backend.lock(...)`",
                name,
                token,
            )
            await cleanup(self.driver.release(name, owner, token), self.bounds, "release dropped")
            self.wake(name)

    async def _sleep_until(self, when: float, slot: str) -> None:
        with anyio.CancelScope() as scope:
            setattr(self, slot, scope)
            if when == math.inf:
                await anyio.sleep_forever()
            else:
                await self.clock.sleep_until(when)
        setattr(self, slot, None)

    # -- the renewer's book-keeping of ttl changes -----------------------------------------

    def _extends_for(self, refs: list[LeaseRef]) -> dict[str, ExtendRequest]:
        """The extend requests this round sends; their refs get the new ttl (in place)."""
        asked: dict[str, ExtendRequest] = {}
        for i, ref in enumerate(refs):
            request = self.extends.get(ref.owner)
            if request is not None and not request.sent:
                request.sent = True
                asked[ref.owner] = request
                refs[i] = LeaseRef(ref.name, ref.owner, ref.token, request.ttl)
        return asked

    def _extended(self, lease: Lease, ref: LeaseRef, result: object, t_send: float) -> None:
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

    def _end_extend(
        self, lease: Lease, result: object, request: ExtendRequest | None = None
    ) -> None:
        """Answer ``request`` (default: the lease's pending one) with ``result``."""
        pending = self.extends.get(lease.owner)
        if request is None:
            request = pending
        if request is None:
            return
        if pending is request:
            del self.extends[lease.owner]
        request.result = result
        request.done.set()

    def _after_extends(self, t_send: float, backing_off: bool) -> float:
        """When the next round runs after one that changed a ttl or left a request."""
        if any(not request.sent for request in self.extends.values()):
            return self.clock.now()
        live = self.live()
        if not live:
            return self._next_round
        # The period of the ttls now held (this round's was computed from the old ones).
        shortest = min(lease.ttl for lease in live) * self.heartbeat
        if backing_off:
            return min(self._next_round, t_send + shortest)
        return t_send + shortest


class ExtendRequest:
    """One ``lease.extend(ttl)`` waiting for the renewer's answer."""

    __slots__ = ("done", "result", "sent", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.sent = False
        self.result: object = None
        self.done = anyio.Event()


def deadline_reason(lease: Lease, now: float) -> str:
    """Why a lease whose :attr:`Lease.deadline` has passed is lost."""
    hard = lease.hard_deadline is not None and now >= lease.hard_deadline
    return "max_hold reached" if hard else "local deadline passed"


def _poke(scope: anyio.CancelScope | None) -> None:
    if scope is not None:
        scope.cancel()
