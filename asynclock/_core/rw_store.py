"""What a server does for read-write locks (``_core/rwlock.py`` is the life of a hold):
the :class:`RWStore` base every backend's read-write lock store extends.

A store is one read-write lock (a name) on one server. Its two modes are two
:class:`~.keeper.Grants` (:attr:`RWStore.reads`, :attr:`RWStore.writes`): the core's
acquire, wait and clean-up path (``Holds.acquire``) runs over each exactly as over a
driver's locks, and the session renews every hold of a mode in one :meth:`RWStore.extend`
call per round. A backend implements four atomic server steps: :meth:`RWStore.grant`,
:meth:`RWStore.extend`, :meth:`RWStore.release_hold` and :meth:`RWStore.withdraw`.

The server keeps, per name: the **epoch** (the token of the last write hold granted:
never reset, so it only rises), the live **readers** (owner -> expiry, each granted with
the epoch of its time), the live **writer** (owner, epoch, expiry) and the live
**intents** of waiting writers (owner -> expiry). A grant, atomically:

* a read: granted (token = the epoch) if no live writer and no live intent;
* a write: granted (token = epoch + 1, the new epoch; the writer's intent removed) if no
  live writer and no live reader; otherwise, if the writer waits (``intend``), its intent
  is recorded or renewed for ``ttl`` seconds. A waiting writer polls at most every
  ``ttl / 10`` seconds (:func:`~.permit_store.backoff`), so a live writer's intent never
  expires while it waits; a dead one's (its process gone) expires within its ttl, and a
  writer that gives up (timeout, cancelled) withdraws it at once.

Expired readers, writers and intents count for nothing (each is a lease with a ttl).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .holder import Holder
from .keeper import Busy, ExtendResult, LeaseRef
from .permit_store import backoff
from .wakes import Waker, wake_name

#: A hold's lease is named ``rwlock:<name>``, both modes: apart from a lock or a semaphore
#: of the same name (``break_lock(name)`` does not touch read-write holds).
LEASE_PREFIX = "rwlock:"

#: The two modes (as the servers store them).
READ, WRITE = "r", "w"


@dataclass(frozen=True, slots=True)
class Held:
    """Not granted: ``why`` (for LockHeld's message) and when the first of what blocks
    it expires at the latest (seconds), if known."""

    why: str
    retry_after: float | None = None


#: The answer to a grant: the hold's token, or why not.
RWAnswer = int | Held

# The reasons, as each store words them.
WRITER_HOLDS = "a writer holds it"
READERS_HOLD = "readers hold it"
WRITER_WAITS = "a writer is waiting (writers go first)"


class RWStore:
    """One read-write lock on one server (see the module). Subclasses implement
    :meth:`grant`, :meth:`extend`, :meth:`release_hold` and :meth:`withdraw`."""

    #: True if grant() may wait in this process before its statement goes out, and
    #: then sets SENT_AT (see :data:`~.keeper.SENT_AT`).
    queues_locally = False

    #: For messages; never contains a password.
    display: str = "rwlock"
    #: See :class:`~.keeper.Keeper`.
    renew_chunk: int | None = 1000
    #: What wakes waiters in other processes when a hold is released (or an intent
    #: withdrawn) at the server: the driver's lock watch on :attr:`wake_name` (see
    #: ``_core/wakes.py``), or None: they poll.
    waker: Waker | None = None

    def __init__(self, name: str) -> None:
        self.name = name
        #: The reserved name a release here notifies (where the backend notifies).
        self.wake_name = wake_name(LEASE_PREFIX + name)

    @cached_property
    def reads(self) -> ModeGrants:
        """The read mode's :class:`~.keeper.Grants`."""
        return ModeGrants(self, READ)

    @cached_property
    def writes(self) -> ModeGrants:
        """The write mode's :class:`~.keeper.Grants`."""
        return ModeGrants(self, WRITE)

    # -- what a backend implements ----------------------------------------------------------

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        """One atomic attempt to hold the lock in ``mode`` for ``ttl`` seconds (see the
        module); ``intend``: a writer that waits records or renews its intent if busy."""
        raise NotImplementedError

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        """Renew these holds of ``mode`` (owner- and token-checked), one result each."""
        raise NotImplementedError

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        """Owner-checked release of ``owner``'s live hold of ``mode`` (``token`` None: an
        interrupted grant). True if it freed our hold."""
        raise NotImplementedError

    async def withdraw(self, owner: str) -> None:
        """Remove ``owner``'s intent to write (it stopped waiting), if any."""
        raise NotImplementedError

    async def holders(self) -> list[Holder]:
        """The live writer, readers and waiting writers' intents as the server sees them
        (:func:`rw_holders`). For operators (``rw.holders()``, ``asynclock holder``);
        NotImplementedError where not built."""
        raise NotImplementedError(f"{self.display} does not list a read-write lock's holds")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} on {self.display}>"


#: (owner, seconds left or None) of one live hold or intent.
Live = tuple[str, float | None]


def rw_holders(
    name: str, epoch: int, writer: Live | None, readers: Sequence[Live], intents: Sequence[Live]
) -> list[Holder]:
    """What :meth:`RWStore.holders` answers: the writer (kind ``write``, token the epoch),
    then the readers (``read``, the epoch: no writer is granted while a reader lives, so
    every live reader reads the current one), then the intents (``intent``, no token),
    each group by owner."""

    def one(live: Live, kind: str, token: int | None) -> Holder:
        left = None if live[1] is None else max(0.0, live[1])
        return Holder(name, live[0], token, left, kind=kind)

    found = [] if writer is None else [one(writer, "write", epoch)]
    found += [one(r, "read", epoch) for r in sorted(readers)]
    found += [one(i, "intent", None) for i in sorted(intents)]
    return found


class ModeGrants:
    """One mode of an :class:`RWStore` as a :class:`~.keeper.Grants` (what the core's
    acquire, wait, renewal and release run over). Waiting is polled with the semaphores'
    bounded backoff, and woken by this backend's own releases of the name and, where the
    store has a waker, by the server's notification of any release."""

    wakes_waiters = False

    @property
    def queues_locally(self) -> bool:
        """As the store (see :data:`~.keeper.SENT_AT`)."""
        return self.store.queues_locally

    def __init__(self, store: RWStore, mode: str) -> None:
        self.store = store
        self.mode = mode
        self.display = store.display
        self.renew_chunk = store.renew_chunk
        self._tries: dict[str, int] = {}

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        answer = await self.store.grant(self.mode, owner, ttl, intend=queue and self.mode == WRITE)
        if not isinstance(answer, Held):
            self._tries.pop(owner, None)
            return answer
        tries = self._tries.get(owner, 0)
        if queue:
            self._tries[owner] = tries + 1
        delay = backoff(tries, ttl)
        if answer.retry_after is not None:
            delay = min(delay, max(0.001, answer.retry_after))
        what = "read" if self.mode == READ else "write"
        return Busy(delay, f"rwlock {self.store.name!r} cannot be {what}-held: {answer.why}")

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        return await self.store.extend(self.mode, leases)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        return await self.store.release_hold(self.mode, owner, token)

    async def watch(self, name: str, cursor: object = None) -> bool:
        store = self.store
        waker = store.waker
        return False if waker is None else await waker.watch(store.wake_name, cursor)

    async def unwatch(self, name: str) -> None:
        store = self.store
        if store.waker is not None:
            await store.waker.unwatch(store.wake_name)

    async def abandon(self, name: str, owner: str) -> None:
        self._tries.pop(owner, None)
        if self.mode == WRITE:
            await self.store.withdraw(owner)

    def __repr__(self) -> str:
        return f"<ModeGrants {self.mode} of {self.store!r}>"
