"""The server side of a kind of hold, as the session's renewer sees it: what identifies a
lease at the server, what a renewal answers, and the :class:`Keeper` that renews and
releases leases (a driver for its locks; a feature's store for its own)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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
