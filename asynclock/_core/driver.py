"""The seam between the core and a backend.

A driver does atomic primitives against its server and nothing else: no timing, no
retries, no renewal loops, no cancellation handling. Those live once, in the core.
Every method may raise :class:`~asynclock.BackendUnavailable` (translate driver errors at
this boundary); any other exception is treated the same way by the core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .clock import Clock, MonotonicClock
from .holder import Holder


@dataclass(frozen=True, slots=True)
class Busy:
    """An acquire attempt found the name held.

    ``retry_after`` is how long the current lease has left at most (Redis ``PTTL``, a
    lease row's expiry), or a backend's suggested poll delay; ``None`` if unknown.
    ``detail``, if given, says why (it goes into :class:`~asynclock.LockHeld`'s message).
    ``cursor``, if given, is opaque to the core: where the driver's watch should start
    (etcd: the revision the attempt read). The core passes it to ``watch(name, cursor)``.
    ``grace_until``, if given, means the server grants nothing before that Unix time (its
    restart grace after data loss), not that someone holds the name: ``retry_after`` is
    then the time left and ``detail`` says why; the core raises
    :class:`~asynclock.RestartGrace` instead of :class:`~asynclock.LockHeld`.
    """

    retry_after: float | None = None
    detail: str | None = None
    cursor: object = None
    grace_until: float | None = None


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """What identifies one lease at the server, plus the ttl to renew it with."""

    name: str
    owner: str
    token: int
    ttl: float


@dataclass(frozen=True, slots=True)
class Refused:
    """The server definitely says this lease is no longer ours (G5); ``reason`` says why."""

    reason: str


#: One renewal result: ``True`` (extended by its ttl, measured from before the call),
#: :class:`Refused` (definite loss), or an exception (unknown; the core retries).
ExtendResult = bool | Refused | BaseException


class ThreadCalls(Protocol):
    """A driver's blocking acquire and release, for a thread other than the backend's
    loop thread (``asynclock.from_thread``): each is one server round trip made on the
    calling thread. Only the calls themselves: the lease's bookkeeping stays on the loop
    (:meth:`Driver.adopted`, :meth:`Driver.forget`)."""

    def acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """The token if granted now, else None (busy, or a restart grace): never waits and
        never joins a wait queue, and respects one (a queued waiter goes first)."""
        ...

    def release(self, name: str, owner: str, token: int) -> bool:
        """Release, owner-checked (G6), as :meth:`Driver.release`."""
        ...


class Driver:
    """Base class of every backend driver. Subclasses override the ``async`` primitives."""

    #: URL scheme(s) for messages; never contains a password.
    display: str = "driver"
    #: False where :meth:`holder` cannot name the owner of every holder (the server keeps
    #: none for some of them), so ``backend.leader()`` refuses rather than answer wrongly.
    tells_owner: bool = True

    #: True if every acquire and release is a server round trip that suspends the caller
    #: (network drivers). The core then relies on that suspension: a caller cancelled
    #: before it asks is cancelled there (no checkpoint of its own first), and a release's
    #: deadline is armed up front instead of at its first suspension. Leave False if a
    #: call can finish without suspending (in-process or in-thread drivers).
    remote: bool = False

    def __init__(self) -> None:
        self.clock: Clock = MonotonicClock()
        self._wake: Callable[[str], None] = lambda name: None
        self._notify_lost: Callable[[str, str, str], None] = lambda name, owner, why: None
        self._renew_now: Callable[[], None] = lambda: None

    def bind(
        self,
        clock: Clock,
        wake: Callable[[str], None],
        notify_lost: Callable[[str, str, str], None],
        renew_now: Callable[[], None] | None = None,
    ) -> None:
        """Called once by the backend: ``wake(name)`` when a release of ``name`` is seen,
        ``notify_lost(name, owner, reason)`` when a lease is known lost out of band,
        ``renew_now()`` to have every held lease renewed at once (a connection came back:
        the server may have restarted and lost them)."""
        self.clock = clock
        self._wake = wake
        self._notify_lost = notify_lost
        if renew_now is not None:
            self._renew_now = renew_now

    def thread_calls(self) -> ThreadCalls | None:
        """Blocking calls for other threads (see :class:`ThreadCalls`), or None (the
        default): a thread then asks the backend's loop thread, one hop per call."""
        return None

    def adopted(self, name: str, owner: str) -> None:
        """On the loop: a lease granted by :meth:`ThreadCalls.acquire` is now held (keep
        what :meth:`acquire` keeps for a grant)."""

    def forget(self, owner: str) -> None:
        """On the loop: a lease released by :meth:`ThreadCalls.release` (or abandoned) is
        no longer held (drop what :meth:`release` drops)."""

    async def open(self) -> None:
        """Connect, create schema, load scripts. Raise BackendUnavailable with a clear message."""

    async def aclose(self) -> None:
        """Close connections. Must not raise."""

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        """One atomic attempt. Return the new fencing token, or :class:`Busy`.

        ``queue`` is true for a blocking waiter: a backend with a fair queue may register
        ``owner`` as waiting (see :meth:`abandon`).

        ``scope`` (a token scope, validated like a name) is None for the name's own counter;
        otherwise the token must be greater than every token handed out before for the
        scope *and* for the name (G2 for both), drawn in the same atomic step as the grant.
        """
        raise NotImplementedError

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        """Renew every lease in one round trip; one result per lease, in order (G5, G7)."""
        raise NotImplementedError

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Owner-checked delete. True if it removed our lease, False if it was not ours.

        ``token`` is None when an acquire was interrupted and the token is unknown.
        """
        raise NotImplementedError

    async def validate(self, name: str, token: int) -> bool:
        """Is ``token`` the live holder's token of ``name`` right now (G9)?"""
        raise NotImplementedError

    async def background(self) -> None:
        """Runs in the backend's task group for the backend's life (readers, listeners).

        Return at once if there is nothing to run; it is cancelled when the backend closes.
        """

    async def watch(self, name: str, cursor: object = None) -> bool:
        """Start calling ``wake(name)`` on releases of ``name`` (pub/sub, LISTEN, watch).

        Return True if a release that happened after the last failed attempt may have
        been missed (the subscription is new), so the core should try again at once;
        False if nothing can have been missed (already subscribed, or no notifications).

        ``cursor`` is the failed attempt's :attr:`Busy.cursor` (None if it set none): where
        that attempt left off. The core calls ``watch`` again with the new cursor whenever
        a later failed attempt of the same wait returns a different one (``!=``): the
        driver moves its watch there. :meth:`unwatch` is still called once, when the wait
        ends.
        """
        return False

    async def unwatch(self, name: str) -> None:
        """Stop what :meth:`watch` started (called once per wait that watched)."""

    async def abandon(self, name: str, owner: str) -> None:
        """A queued waiter gave up (timeout or cancellation); forget it."""

    async def names(self) -> list[str]:
        """Every name the server keeps a lease record of (held or not: the core asks
        :meth:`holder` of each), for operators (``backend.holders()``). NotImplementedError
        where the server cannot enumerate the names (it says why)."""
        raise NotImplementedError(f"{self.display} cannot list lock names")

    async def holder(self, name: str) -> Holder | None:
        """Who holds ``name`` right now (the server's view), or None if nobody does.

        A name reserved for a queued waiter, or whose lease expired, is not held. The one
        query behind both ``backend.holder()`` and ``backend.leader()`` (which reads the
        leader's identity out of :attr:`Holder.owner`; see :attr:`tells_owner`).
        """
        raise NotImplementedError(f"{self.display} does not report holders")

    async def break_lock(self, name: str) -> bool:
        """Remove whoever holds ``name``, for operators; True if a live lease was removed.

        Must keep G2: the next acquisition's token is above the broken lease's token. The
        broken holder's next extend must be refused (its next renewal then loses it).
        """
        raise NotImplementedError(f"{self.display} cannot break locks")


def leave_queue(queues: dict[str, deque[str]], name: str, owner: str) -> bool:
    """Take ``owner`` out of a driver's local FIFO queue of waiters for ``name`` (dropping
    the queue once empty); True if it was in it (the head may have left: wake the next)."""
    waiting = queues.get(name)
    if waiting is None or owner not in waiting:
        return False
    waiting.remove(owner)
    if not waiting:
        del queues[name]
    return True
