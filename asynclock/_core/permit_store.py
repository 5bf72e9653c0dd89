"""What a server does for counting semaphores (``_core/semaphore.py`` is the life of a
permit): the :class:`PermitStore` base every backend's semaphore store extends.

A store is one semaphore (a name and its limit) on one server. It is the
:class:`~.keeper.Grants` of its permits: the core's acquire, wait and clean-up path
(``Holds.acquire``) runs over it exactly as over a driver's locks, and the session renews
every permit of the store in one :meth:`extend` call per round. A backend implements three
atomic server steps: :meth:`grant`, :meth:`extend`, :meth:`release_permit`, and
:meth:`withdraw` for its wait queue.

**Waiters are served first come, first served** (issue 42): each semaphore has a queue of
*places* at the server, one per blocking waiter, in arrival order. A grant is made only
when fewer live places are ahead of the asker than permits are free, so neither a later
waiter, a ``blocking=False`` attempt nor a waiter that happens to poll right after a
release can overtake an earlier waiter. A place is kept by asking again (every poll, at
most :data:`MAX_POLL` apart) and lapses :func:`place_ttl` seconds after the last ask: a
waiter whose process died or froze is skipped then, without holding anything; a waiter
that gives up (timeout, cancellation) withdraws its place at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .exceptions import SemaphoreLimitMismatch
from .holder import Holder
from .keeper import Busy, ExtendResult, LeaseRef
from .wakes import Waker, wake_name

#: The largest ``limit`` a semaphore may have: each permit is a slot the server keeps
#: (a row, a hash field) and a grant may look at every live one.
MAX_LIMIT = 10_000

#: A permit's lease is named ``semaphore:<name>``: apart from a lock of the same name (a
#: lock of ``name`` may be taken inside a permit's body, and ``break_lock(name)`` does not
#: touch permits).
LEASE_PREFIX = "semaphore:"

#: The waiting backoff: the first retry after this many seconds, doubling per busy answer
#: up to a tenth of the waiter's ttl, never above :data:`MAX_POLL`. Where the store has a
#: :attr:`~PermitStore.waker`, a release at the server wakes the waiters before that (the
#: poll is then only the fallback for a missed notification, or an expiry).
FIRST_POLL = 0.01
MAX_POLL = 0.5
#: Where no release wakes the waiters (no :attr:`~PermitStore.waker`), the first
#: :data:`NEXT_IN_LINE` waiters in the queue poll this often: a released permit is theirs
#: alone (first come, first served), so the hand-off waits for one of their polls, not for
#: the quickest of every waiter's.
NEXT_POLL = 0.02
NEXT_IN_LINE = 3


@dataclass(frozen=True, slots=True)
class Granted:
    """A permit the server granted: its slot (0 .. limit-1) and the slot's new token."""

    slot: int
    token: int


@dataclass(frozen=True, slots=True)
class Full:
    """Every permit is held, or the free ones are owed to waiters ahead. ``retry_after``:
    when the first permit expires at the latest (seconds), if known; ``ahead``: how many
    live places are ahead of the asker's, if known (a store without a :attr:`waker` then
    has the first few waiters poll fast: see :data:`NEXT_POLL`)."""

    retry_after: float | None = None
    ahead: int | None = None


@dataclass(frozen=True, slots=True)
class OtherLimit:
    """Permits of the name are held under another limit (``held_limit``)."""

    held_limit: int


Answer = Granted | Full | OtherLimit


def check_limit(limit: object) -> int:
    """A semaphore's limit: an int from 1 to :data:`MAX_LIMIT` (not a bool)."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(
            f"limit must be an int from 1 to {MAX_LIMIT} (the number of permits), "
            f"not {type(limit).__name__} {limit!r}"
        )
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit must be from 1 to {MAX_LIMIT} permits, got {limit} (a semaphore of "
            "limit 1 is a lock; more than 10000 slots is not supported)"
        )
    return limit


def backoff(tries: int, ttl: float) -> float:
    """The poll delay after ``tries`` busy answers: 10 ms doubling up to ttl/10, at most
    0.5 s (and never below 10 ms)."""
    cap = min(MAX_POLL, max(FIRST_POLL, ttl / 10))
    return min(cap, FIRST_POLL * float(2 ** min(tries, 16)))


#: The longest a queued waiter's place lasts without an ask (see :func:`place_ttl`).
MAX_PLACE_TTL = 5.0


def place_ttl(ttl: float) -> float:
    """How long a queued waiter's place lasts after its last ask: half the waiter's ttl,
    at least 1 s, at most :data:`MAX_PLACE_TTL` — always five or more of its polls
    (:func:`backoff`'s cap is a tenth of the ttl, at most 0.5 s), so a loaded process
    that is late for one or two keeps its place. A place that lapses is skipped by every
    grant (a dead waiter delays the queue by at most this, where a dead holder delays it by
    its ttl); its waiter, if alive, takes a new place at the end of the queue on its next
    ask."""
    return min(MAX_PLACE_TTL, max(1.0, ttl / 2))


def permit_holder(
    name: str, slot: int, owner: str | None, token: int, remaining: float | None, limit: int | None
) -> Holder:
    """One live permit as :meth:`PermitStore.holders` lists it."""
    left = None if remaining is None else max(0.0, remaining)
    return Holder(name, owner, token, left, kind="permit", slot=slot, limit=limit)


class PermitStore:
    """One semaphore on one server (see the module). Subclasses implement :meth:`grant`,
    :meth:`extend` and :meth:`release_permit`; the slot of each permit granted here is
    kept by owner until it is released (:meth:`slot_of`)."""

    #: For messages; never contains a password.
    display: str = "semaphore"
    #: See :class:`~.keeper.Keeper`.
    renew_chunk: int | None = 1000
    #: The core wakes this backend's waiters of the name on every release here.
    wakes_waiters = False
    #: What wakes waiters in other processes on a release at the server (the driver's
    #: lock watch on :attr:`wake_name`, see ``_core/wakes.py``), or None: they poll.
    waker: Waker | None = None
    #: Requests go out at once (see :data:`~.keeper.SENT_AT`).
    queues_locally = False

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        #: owner -> slot of every permit granted here and not yet released.
        self.slots: dict[str, int] = {}
        self._tries: dict[str, int] = {}
        #: Slots grants of this store are trying now (see :meth:`guess_slot`).
        self.trying: set[int] = set()
        #: The reserved name a release here notifies (where the backend notifies).
        self.wake_name = wake_name(LEASE_PREFIX + name)

    # -- what a backend implements ----------------------------------------------------------

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        """One atomic attempt: a free slot below the limit for ``owner`` for ``ttl``
        seconds (the slot's token bumped), or why not.

        First come, first served (see the module): granted only when fewer live places
        of other waiters are ahead of ``owner``'s (all of them, if it has none) than
        permits are free; a grant removes ``owner``'s place. Not granted and ``queue``
        (a blocking waiter): ``owner``'s place is kept, or taken at the end of the
        queue, for :func:`place_ttl` (``ttl``) seconds from now."""
        raise NotImplementedError

    async def withdraw(self, owner: str) -> None:
        """Remove ``owner``'s place from the queue, if it has one (it gave up)."""
        raise NotImplementedError

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        """Renew these permits (owner- and token-checked), one result per lease."""
        raise NotImplementedError

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        """Owner-checked release (``slot`` None: an interrupted grant, look for ``owner``
        in every slot). True if it freed our permit."""
        raise NotImplementedError

    async def holders(self) -> list[Holder]:
        """Every live permit of the name as the server sees it, whatever its limit (this
        store's is not checked), by slot: :func:`permit_holder` each. For operators
        (``sem.holders()``, ``asynclock holder``); NotImplementedError where not built."""
        raise NotImplementedError(f"{self.display} does not list a semaphore's permits")

    def guess_slot(self, live: Iterable[int], trying: list[int]) -> int | None:
        """For a store that tries one slot per request: a slot neither live (as last seen)
        nor held or tried by a task here (tasks of one process never collide), lowest
        first, added to ``trying`` and :attr:`trying` (the grant removes it from
        :attr:`trying` when it ends); None if there is none."""
        taken = set(live) | set(self.slots.values()) | self.trying
        slot = next((s for s in range(self.limit) if s not in taken), None)
        if slot is not None:
            self.trying.add(slot)
            trying.append(slot)
        return slot

    # -- keeper.Grants ----------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        answer = await self.grant(owner, ttl, queue=queue)
        if isinstance(answer, Granted):
            self.slots[owner] = answer.slot
            self._tries.pop(owner, None)
            return answer.token
        if isinstance(answer, OtherLimit):
            self._tries.pop(owner, None)
            raise SemaphoreLimitMismatch(self.name, self.limit, answer.held_limit)
        tries = self._tries.get(owner, 0)
        if queue:
            self._tries[owner] = tries + 1
        delay = backoff(tries, ttl)
        if answer.retry_after is not None:
            delay = min(delay, max(0.001, answer.retry_after))
        ahead = answer.ahead
        if self.waker is None and ahead is not None and ahead < min(self.limit, NEXT_IN_LINE):
            delay = min(delay, NEXT_POLL)
        return Busy(delay, f"all {self.limit} permits of semaphore {self.name!r} are held")

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        slot = self.slots.pop(owner, None)
        return await self.release_permit(owner, slot, token)

    async def watch(self, name: str, cursor: object = None) -> bool:
        # Woken by this backend's own releases (the core), and by the server's notification
        # of any release where there is a waker; polled with the backoff either way.
        waker = self.waker
        return False if waker is None else await waker.watch(self.wake_name, cursor)

    async def unwatch(self, name: str) -> None:
        if self.waker is not None:
            await self.waker.unwatch(self.wake_name)

    async def abandon(self, name: str, owner: str) -> None:
        self._tries.pop(owner, None)
        await self.withdraw(owner)

    def slot_of(self, owner: str) -> int:
        return self.slots[owner]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} limit={self.limit} on {self.display}>"
