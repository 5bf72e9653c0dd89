"""The heartbeat: when each held lease is renewed, in how many calls, and what a renewer
that falls behind says (G7; the session's half of the book-keeping is ``session.py``).

* **Each lease at its own cadence.** A lease is due ``ttl x heartbeat`` after the request
  that set its deadline was sent. A round renews every lease due now and, so that leases
  travel together instead of one call each, every lease due within half its own interval
  (so a lease is renewed between 1/2 and 1 interval after the last time).
* **In chunks, most urgent first.** A round's leases are sorted by deadline and cut into
  calls of at most the keeper's ``renew_chunk`` (a driver whose one round trip renews
  every key, like a server session, takes any number); up to :data:`CONCURRENCY` calls are
  in flight at once, and each call's results are applied as soon as it answers, so a large
  batch never waits for its slowest part and no server call grows without bound.
* **Behind is loud before it is fatal.** A lease sent with less than half of the time
  between its renewal and its deadline left means the renewer (or the event loop) is
  falling behind: a WARNING with the figures (rate-limited), ``stats().renewals_late`` and
  the observers' ``renewal_behind`` — before any deadline passes, so an operator can act.
* **Errors back off.** A call that fails (not a refusal) is retried, with backoff, until
  the lease's deadline; a refusal loses the lease at once (G5).
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .clock import Clock
from .keeper import Keeper, LeaseRef
from .lease import deadline_reason
from .observer import Observer
from .stats import StatsRecorder

if TYPE_CHECKING:
    import weakref

    from .lease import Lease

logger = logging.getLogger("asynclock")

#: Leases due within this fraction of their own interval ride the current round.
COALESCE = 0.5
#: Renewal calls in flight at once in one round.
CONCURRENCY = 4
#: A lease sent with less than this fraction of its renewal budget (the time from its
#: renewal to its deadline) left is late: the renewer is falling behind.
BEHIND = 0.5
#: At most one "renewer behind" WARNING per this many seconds (the rest are counted).
WARN_EVERY = 30.0
#: How long the idle renewer sleeps before looking again (no leases held).
IDLE_NAP = 1.0


class Due:
    """The leases one keeper renews in a round: two lists side by side (the lease, what
    identifies it at the server), not an object per lease. With 100,000 leases held, an
    object per lease per round is 100,000 more for the garbage collector to promote and
    walk with everything else: the collector then took most of the process's CPU."""

    __slots__ = ("leases", "refs")

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.refs: list[LeaseRef] = []

    def part(self, start: int, stop: int) -> Due:
        part = Due()
        part.leases = self.leases[start:stop]
        part.refs = self.refs[start:stop]
        return part

    def by_deadline(self) -> None:
        """Most urgent first (the lists sorted together)."""
        leases = self.leases
        order = sorted(range(len(leases)), key=[lease._deadline for lease in leases].__getitem__)
        self.leases = [leases[i] for i in order]
        refs = self.refs
        self.refs = [refs[i] for i in order]


class Leases(Protocol):
    """What the renewer needs of the session (``session.Session``)."""

    clock: Clock
    heartbeat: float
    keep: float
    margin: float
    display: str
    stats: StatsRecorder
    observer: Observer | None
    held: dict[str, tuple[weakref.ref[Lease], str, int, Keeper]]
    extends: dict[str, ExtendRequest]
    inbox: deque[tuple[Callable[..., None], tuple[Any, ...]]]
    inbox_used: bool
    dropped: list[weakref.ref[Lease]]

    def run_inbox(self) -> None: ...

    def lose(self, lease: Lease, reason: str) -> None: ...

    def flush_release_failures(self) -> None: ...

    async def reap_dropped(self) -> None: ...

    def apply_renewals(
        self,
        leases: list[Lease],
        refs: list[LeaseRef],
        results: Sequence[object],
        t_send: float,
        asked: dict[str, ExtendRequest] | None,
        round_trip: float,
        lag: float,
    ) -> int: ...


class ExtendRequest:
    """One ``lease.extend(ttl)`` waiting for the renewer's answer."""

    __slots__ = ("done", "result", "sent", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.sent = False
        self.result: object = None
        self.done = anyio.Event()


class Renewer:
    """Runs the session's renewal rounds (one task per backend: rounds never overlap, so
    the server's expiry of a lease is always the last one sent)."""

    def __init__(self, session: Leases) -> None:
        self.session = session
        #: When the next round runs (the session's clock).
        self.next_round: float = math.inf
        self._wake: anyio.CancelScope | None = None
        self._all_now = False  # renew_all_now() asked: the next round takes every lease
        self._round_done = anyio.Event()
        self._failures = 0
        self._warned_at = -math.inf
        self._unwarned = 0  # late leases not yet reported in a WARNING
        #: Seconds the last round took, from its first call to its last answer.
        self.last_round = 0.0

    # -- what the session and the backend ask of it ------------------------------------------

    def wake_at(self, when: float) -> None:
        """Run a round no later than ``when``."""
        if when < self.next_round:
            self.next_round = when
            if self._wake is not None:
                self._wake.cancel()

    def renew_all_now(self) -> None:
        """Renew every held lease now (a connection came back: the server may have lost
        them), not each at its cadence."""
        self._all_now = True
        if self.session.held:
            self.wake_at(self.session.clock.now())

    async def next_round_done(self) -> None:
        await self._round_done.wait()

    def _round_ended(self) -> None:
        self._round_done.set()
        self._round_done = anyio.Event()

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        session = self.session
        clock = session.clock
        while True:
            now = clock.now()
            if not session.held and self.next_round <= now:
                # Nap instead of parking at infinity: a grant within the nap then needs no
                # wake-up call (tight acquire/release loops stay cheap).
                self.next_round = now + IDLE_NAP
            wake_at = self.next_round
            if session.inbox_used:  # other threads leave work: look at least every IDLE_NAP
                wake_at = min(wake_at, now + IDLE_NAP)
            with anyio.CancelScope() as scope:
                self._wake = scope
                if wake_at == math.inf:
                    await anyio.sleep_forever()
                else:
                    await clock.sleep_until(wake_at)
            self._wake = None
            session.flush_release_failures()
            if session.inbox:
                session.run_inbox()
            if session.dropped:
                await session.reap_dropped()
                if not session.held:  # nothing left to renew: this was the round
                    self._round_ended()
            if not session.held:
                continue
            now = clock.now()
            late_by = now - self.next_round
            if late_by < 0:
                continue
            items, next_due = self._due(now)
            if not items:
                self.next_round = next_due
                continue
            self.next_round = math.inf  # a grant or an extend during the round lowers it
            errors = await self._round(items, now, late_by)
            self._round_ended()
            # (After the round: an extend it carried may have shortened a ttl.)
            shortest = max(
                min(lease.ttl for due in items.values() for lease in due.leases)
                * session.heartbeat,
                0.01,
            )
            if errors:
                self._failures += 1
                backoff = min(shortest, 0.02 * 2 ** min(self._failures, 10))
                next_due = min(next_due, clock.now() + backoff * (0.5 + random.random() / 2))
            else:
                self._failures = 0
            next_due = min(next_due, now + shortest)
            if any(not request.sent for request in session.extends.values()) or self._all_now:
                next_due = clock.now()
            self.next_round = min(self.next_round, next_due)

    def _due(self, now: float) -> tuple[dict[Keeper, Due], float]:
        """The leases to renew now, by keeper, and when the next of the others is due."""
        session = self.session
        every = self._all_now
        self._all_now = False
        extends = session.extends
        hb = session.heartbeat
        # A lease's renewal falls due ttl x heartbeat after its deadline's request was sent:
        # at its deadline - ttl x (keep - heartbeat) + margin.
        before = session.keep - hb
        margin = session.margin
        due: dict[Keeper, Due] = {}
        last_keeper: Keeper | None = None
        part = Due()
        next_due = math.inf
        late: list[Lease] = []
        # (No copy of the dict: nothing here changes it, and a copy of 100,000 entries per
        # round is garbage the collector then walks with everything else.)
        for owner, (ref_w, name, token, keeper) in session.held.items():
            lease = ref_w()
            if lease is None or lease._released:
                continue
            if now >= lease.deadline:  # the loop was stalled: the watchdog has not run yet
                late.append(lease)
                continue
            ttl = lease.ttl
            renew_at = lease._deadline - ttl * before + margin
            if every or renew_at <= now + ttl * hb * COALESCE or owner in extends:
                if keeper is not last_keeper:
                    part = due.get(keeper) or due.setdefault(keeper, Due())
                    last_keeper = keeper
                part.leases.append(lease)
                part.refs.append(LeaseRef(name, owner, token, ttl))
            elif renew_at < next_due:
                next_due = renew_at
        for lease in late:  # lost for what it is, not renewed (a refusal would misname it)
            session.lose(lease, deadline_reason(lease, now))
        return due, next_due

    async def _round(self, items: dict[Keeper, Due], now: float, late_by: float) -> int:
        """Renew ``items``; returns how many failed without a refusal."""
        chunks = self._chunks(items)
        self._check_behind(items, now, late_by, len(chunks))
        started = self.session.clock.now()
        if len(chunks) == 1:
            errors = await self._call(*chunks[0], late_by)
        else:
            queue = deque(chunks)
            failed = [0]

            async def worker() -> None:
                while queue:
                    keeper, part = queue.popleft()
                    failed[0] += await self._call(keeper, part, late_by)

            async with anyio.create_task_group() as tg:
                for _ in range(min(CONCURRENCY, len(chunks))):
                    tg.start_soon(worker)
            errors = failed[0]
        self.last_round = self.session.clock.now() - started
        return errors

    def _chunks(self, items: dict[Keeper, Due]) -> list[tuple[Keeper, Due]]:
        """``items`` cut to each keeper's ``renew_chunk``, most urgent first."""
        chunks: list[tuple[Keeper, Due]] = []
        for keeper, due in items.items():
            n = len(due.leases)
            size = keeper.renew_chunk or n
            if n <= size:
                chunks.append((keeper, due))
                continue
            due.by_deadline()
            chunks.extend((keeper, due.part(i, i + size)) for i in range(0, n, size))
        return chunks

    async def _call(self, keeper: Keeper, items: Due, late_by: float) -> int:
        """One renewal call for ``items`` and its answers applied; returns the failures."""
        session = self.session
        refs = items.refs
        # lease.extend(ttl) requests ride this call with their new ttl.
        asked = self._extends_for(refs) if session.extends else None
        timeout = max(min(ref.ttl for ref in refs) * session.heartbeat, 0.01)
        t_send = session.clock.now()
        results: Sequence[object]
        try:
            with anyio.fail_after(timeout):
                results = await keeper.extend(refs)
            if len(results) != len(refs):
                raise RuntimeError(f"keeper returned {len(results)} results for {len(refs)}")
        except Exception as exc:
            results = [exc] * len(refs)
        round_trip = session.clock.now() - t_send
        session.stats.renewal_round_trips += 1
        return session.apply_renewals(
            items.leases, refs, results, t_send, asked, round_trip, late_by
        )

    # -- falling behind --------------------------------------------------------------------------

    def _check_behind(
        self, items: dict[Keeper, Due], now: float, late_by: float, calls: int
    ) -> None:
        """Count (and, at most every WARN_EVERY seconds, report) the leases sent late."""
        session = self.session
        before = session.keep - session.heartbeat
        margin = session.margin
        late = 0
        worst = math.inf
        count = 0
        for due in items.values():
            count += len(due.leases)
            for lease in due.leases:
                budget = lease.ttl * before - margin  # from its renewal to its deadline
                left = lease.deadline - now
                if left < budget * BEHIND:
                    late += 1
                    worst = min(worst, left)
        if not late:
            return
        session.stats.renewals_late += late
        if session.observer is not None:
            session.observer.renewal_behind(late, worst)
        self._unwarned += late
        if now - self._warned_at < WARN_EVERY:
            return
        self._warned_at = now
        if late_by > worst / 2:
            why = f"the renewer woke {late_by:.3f}s late (the event loop was busy or blocked)"
        else:
            why = (
                f"renewals take too long: the last round took {self.last_round:.3f}s "
                f"for {count} leases in {calls} calls"
            )
        logger.warning(
            "renewer behind on %s: %d leases renewed with less than half of their margin "
            "left (the closest %.3fs before its deadline); %s. Leases are lost if this "
            "goes on: hold fewer leases per process, use longer ttls, or give the event loop "
            "more CPU",
            session.display,
            self._unwarned,
            max(worst, 0.0),
            why,
        )
        self._unwarned = 0

    # -- ttl changes riding a round --------------------------------------------------------------

    def _extends_for(self, refs: list[LeaseRef]) -> dict[str, ExtendRequest]:
        """The extend requests this call sends; their refs get the new ttl (in place)."""
        asked: dict[str, ExtendRequest] = {}
        extends = self.session.extends
        for i, ref in enumerate(refs):
            request = extends.get(ref.owner)
            if request is not None and not request.sent:
                request.sent = True
                asked[ref.owner] = request
                refs[i] = LeaseRef(ref.name, ref.owner, ref.token, request.ttl)
        return asked

    def end_extend(
        self, lease: Lease, result: object, request: ExtendRequest | None = None
    ) -> None:
        """Answer ``request`` (default: the lease's pending one) with ``result``."""
        extends = self.session.extends
        pending = extends.get(lease.owner)
        if request is None:
            request = pending
        if request is None:
            return
        if pending is request:
            del extends[lease.owner]
        request.result = result
        request.done.set()
