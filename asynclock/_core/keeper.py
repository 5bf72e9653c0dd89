"""The server side of a kind of hold, as the session's renewer sees it: what identifies a
lease at the server, what a renewal answers, and the :class:`Keeper` that renews and
releases leases (a driver for its locks; a feature's store for its own)."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol


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
    ``owner``, if given, is the holder's stored owner, where the attempt read it anyway:
    :class:`~asynclock.LockHeld` then names the holder's owner label.
    """

    retry_after: float | None = None
    detail: str | None = None
    cursor: object = None
    grace_until: float | None = None
    owner: str | None = None


class LeaseRef(NamedTuple):
    """What identifies one lease at the server, plus the ttl to renew it with (a tuple:
    the renewer makes one per lease per call, so it is as cheap as Python makes them)."""

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


class Keeper(Protocol):
    """The server side of one kind of hold: how the session renews and releases its leases.

    A driver is the keeper of its locks. A feature whose leases are granted by a server
    step of its own (claimed rows, semaphore permits, partitions) has a keeper of its own
    and hands its leases to the session through ``Holds.adopt``: they are then renewed,
    watched, lost and finished exactly as locks are.
    """

    #: For messages; never contains a password.
    display: str
    #: The most leases one :meth:`extend` call may carry (None: any number, for a keeper
    #: whose one round trip renews every lease, e.g. a server session).
    renew_chunk: int | None

    @property
    def queues_locally(self) -> bool:
        """True if :meth:`acquire` may wait in a queue of this process before its request
        goes out, and sets :data:`SENT_AT` when it does go out."""
        ...

    #: True if the keeper's own release path wakes the local waiters itself (with
    #: ``wake(name, owner)`` for a queue's head): the session then does not wake every
    #: local waiter of the name on each release (no herd of many waiters).
    wakes_waiters: bool

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        """Renew these leases (any subset of those held, at most ``renew_chunk``; several
        calls may be in flight at once): one result per lease, in order (G5, G7)."""
        ...

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Owner-checked release (G5, G6): True if it removed our lease."""
        ...


#: How many leases one renewal call carries unless the driver says otherwise.
RENEW_CHUNK = 1000

#: When an acquire's request actually left this process, for a keeper that queues its
#: requests locally (``queues_locally``): it sets this (clock time) just before the request
#: goes out, in the acquiring task, and the core measures the lease's deadline from it
#: instead of from before the call. A lease that waited in our own queue (2,000
#: acquisitions at once behind ZooKeeper's 64 requests in flight) is then not born past
#: its deadline. Still safe (G3): the server receives the request after it was sent.
SENT_AT: ContextVar[float] = ContextVar("asynclock_sent_at", default=0.0)


class Grants(Keeper, Protocol):
    """A keeper whose leases are acquired and waited for as locks are (by name, with a
    wait queue): a driver for its locks, a semaphore's permits, a read-write lock's
    modes. ``Acquisition.acquire(..., via=grants)`` runs the same acquire, wait, clean-up
    and grant path over it (see :class:`~asynclock._core.driver.Driver` for each call)."""

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy: ...

    async def watch(self, name: str, cursor: object = None) -> bool: ...

    async def unwatch(self, name: str) -> None: ...

    async def abandon(self, name: str, owner: str) -> None: ...
