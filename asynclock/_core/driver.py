"""The seam between the core and a backend.

A driver does atomic primitives against its server and nothing else: no timing, no
retries, no renewal loops, no cancellation handling. Those live once, in the core.
Every method may raise :class:`~asynclock.BackendUnavailable` (translate driver errors at
this boundary); any other exception is treated the same way by the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .claim_store import ClaimStore
from .clock import Clock, MonotonicClock
from .holder import Holder
from .keeper import RENEW_CHUNK, SENT_AT, Busy, ExtendResult, Grants, Keeper, LeaseRef, Refused
from .permit_store import PermitStore
from .rw_store import RWStore

__all__ = (
    "RENEW_CHUNK",
    "SENT_AT",
    "Busy",
    "Driver",
    "ExtendResult",
    "Grants",
    "Keeper",
    "LeaseRef",
    "Record",
    "Refused",
    "ThreadCalls",
    "Wake",
)


@dataclass(frozen=True, slots=True)
class Record:
    """An idempotency record as the server keeps it: the token of the hold that wrote it
    and the payload the core encoded (text, opaque to the driver)."""

    token: int
    payload: str


class Wake(Protocol):
    """``wake(name)``: a release of ``name`` was seen, every local waiter may try again;
    ``wake(name, owner)``: the name was handed to the waiter ``owner`` (a queue's head):
    only that one wakes."""

    def __call__(self, name: str, owner: str | None = None, /) -> None: ...


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
    #: The most leases one :meth:`extend` call carries (see :class:`Keeper`). The session
    #: sends a larger batch as several calls, most urgent first, a few at a time.
    renew_chunk: int | None = RENEW_CHUNK
    #: True if acquire() may wait in a local queue and sets ``SENT_AT`` (see keeper.py).
    queues_locally: bool = False
    #: True if every release this driver makes wakes this backend's waiters of the name
    #: through ``wake`` itself (see :class:`Keeper`); False: the core wakes them all.
    wakes_waiters: bool = False
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
        self._wake: Wake = _no_wake
        self._notify_lost: Callable[[str, str, str], None] = lambda name, owner, why: None
        self._renew_now: Callable[[], None] = lambda: None

    def bind(
        self,
        clock: Clock,
        wake: Wake,
        notify_lost: Callable[[str, str, str], None],
        renew_now: Callable[[], None] | None = None,
    ) -> None:
        """Called once by the backend: ``wake(name)`` when a release of ``name`` is seen
        (``wake(name, owner)`` when it was handed to the queued waiter ``owner``: see
        :class:`Wake`),
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
        """Renew these leases in one round trip; one result per lease, in order (G5, G7).

        ``leases`` is any subset of the leases held (at most :attr:`renew_chunk` of them),
        and several calls may be in flight at once: never infer from a call that a lease
        it does not carry was released."""
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

    async def names_under(self, prefix: str) -> list[str]:
        """The :meth:`names` that start with ``prefix`` (``backend.holders("grp/part/*")``
        asks for ``grp/part/``). Override where the server lists a part of its names for
        less than all of them (ZooKeeper walks one subtree, not every name's node)."""
        return [name for name in await self.names() if name.startswith(prefix)]

    async def hold_names(self) -> tuple[list[str], list[str]]:
        """The names of the semaphores and of the read-write locks the server keeps permits
        or holds of (a name with none live is harmless: the core asks each store's
        ``holders()``), for operators (``backend.holders(kinds=...)``). NotImplementedError
        where the server cannot enumerate them (it says why)."""
        raise NotImplementedError(f"{self.display} cannot list semaphores and read-write locks")

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

    # -- features on the session's hook (see _core/holds.py) ------------------------------

    def claim_store(
        self,
        table: str,
        *,
        where: str | None = None,
        order_by: str | None = None,
        id_column: str = "id",
        schema: str | None = None,
    ) -> ClaimStore:
        """The statements of ``backend.claims(table, ...)`` on this server (see
        ``_core/claims.py``), or NotImplementedError saying why there are none."""
        raise NotImplementedError(
            f"claims need PostgreSQL (postgresql://): a claim locks rows of your own "
            f"table with SELECT ... FOR UPDATE SKIP LOCKED and fences their completion on "
            f"the row's claim token, in the same database; {self.display} has no such "
            "table. Use a lock per item (backend.lock(f'job:{id}', ...)) here."
        )

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        """The server side of ``backend.semaphore(name, limit)`` (see
        ``_core/permit_store.py``), or NotImplementedError saying there is none yet."""
        raise NotImplementedError(
            f"semaphores are not on {self.display} yet: backend.semaphore() works on "
            "memory://, sqlite://, redis://, redis+sentinel://, redis+cluster://, "
            "postgresql:// (both modes), etcd:// and zookeeper://"
        )

    def rwlock_store(self, name: str) -> RWStore:
        """The server side of ``backend.rwlock(name)`` (see ``_core/rw_store.py``), or
        NotImplementedError saying there is none yet."""
        raise NotImplementedError(
            f"read-write locks are not on {self.display} yet: backend.rwlock() works on "
            "memory://, sqlite://, redis://, redis+sentinel://, redis+cluster://, "
            "postgresql:// (both modes), etcd:// and zookeeper://"
        )

    async def claim_holder(self, name: str) -> Holder | None:
        """Who holds the claimed row ``name`` (``claim:<table>:<id>``, as claims name their
        leases) as the server sees it: a Holder (claimed, or stuck: claimed past its
        ttl), or None (the row exists and is not claimed). LookupError if ``name`` is not
        a row of a claims table here (then it is a lock's name like any other)."""
        raise LookupError(name)

    # -- idempotency records (see _core/idempotency.py) ----------------------------------
    #
    # One record per lock name, kept beside the name's lease on the same server. The core
    # calls these only for names in the idempotency namespace, while it holds (or has just
    # held) the name's lease.

    async def record_get(self, name: str) -> Record | None:
        """The unexpired record of ``name``, or None."""
        raise NotImplementedError(f"{self.display} does not store idempotency records")

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        """Store ``payload`` as the record of ``name``, to expire ``keep`` seconds from now,
        only if (owner, token) is the live lease of ``name`` at the server (and no record
        with a larger token exists), checked in the same atomic server step as the write
        (G8). True if stored; False (nothing written) if the lease is not live."""
        raise NotImplementedError(f"{self.display} does not store idempotency records")

    async def record_delete(self, name: str, token: int) -> bool:
        """Delete the record of ``name`` if ``token`` wrote it; True if one was deleted."""
        raise NotImplementedError(f"{self.display} does not store idempotency records")


def _no_wake(name: str, owner: str | None = None, /) -> None:
    pass
