"""Counting semaphores: at most ``limit`` live permits of a name per server, each a lease
of the session with a slot and a token strictly increasing per slot (docs/semaphores.md).

The life of a permit is written once, here, on the session's hook for leases granted
outside ``acquire`` (:class:`~.holds.Holds`); the server's part is a
:class:`~.permit_store.PermitStore` (one per backend: ``driver.semaphore_store``). A
permit:

* is acquired, waited for (woken by a release where the store has a waker, else at its
  next poll with a bounded backoff; first come, first served: see ``permit_store``) and
  cleaned up after an interrupted attempt exactly as a lock is (``Holds.acquire``): busy with
  ``blocking=False`` raises ``LockHeld``, a timeout ``AcquireTimeout``;
* is a lease of the session (named ``semaphore:<name>``): renewed with the store's other
  permits in one call per round, lost when a renewal is refused or its local deadline
  passes, counted in ``stats()``, told to observers, reachable by
  ``asynclock.testing.force_loss``;
* ``async with sem.acquire(ttl=...) as permit:`` runs the body in a cancel scope cancelled
  when the permit is lost (then the block raises ``LeaseLost``; a permit lost before the
  body begins raises there, and the body never runs); the block's exit gives the permit
  back, owner-checked: releasing twice never frees another holder's permit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .context import ExcInfo
from .holder import Holder
from .holds import Holds, LeaseHeld
from .lease import Lease
from .misuse import AsyncContextOnly
from .permit_store import LEASE_PREFIX, MAX_LIMIT, PermitStore, check_limit
from .validation import check_lock_args, check_name, check_not_reserved

if TYPE_CHECKING:
    from .acquisition import Acquisition
    from .driver import Driver

__all__ = ("LEASE_PREFIX", "MAX_LIMIT", "Permit", "PermitHold", "Semaphore", "Semaphores")


class Semaphores:
    """``Backend.semaphore`` (a mixin of the backend: it keeps backend.py small)."""

    _acq: Acquisition
    driver: Driver

    def semaphore(self, name: str, limit: int) -> Semaphore:
        """A counting semaphore: ``async with backend.semaphore("gpu", 4).acquire(ttl=30)
        as permit:`` holds one of at most ``limit`` (1 .. 10000) permits of ``name`` on
        this server; ``permit.slot`` (0 .. limit-1) and ``permit.token`` (strictly
        increasing per slot) fence a resource sharded by slot. A name's semaphore and its
        lock are independent (separate namespaces). Permits of one name held under another
        limit: ``SemaphoreLimitMismatch`` (a ValueError). NotImplementedError on a backend
        without semaphores yet (the message names those that have them). See
        docs/semaphores.md."""
        checked = check_name(name)
        check_not_reserved(checked)
        store = self.driver.semaphore_store(checked, check_limit(limit))
        return Semaphore(Holds(self._acq, store, "permit"), store)


class Semaphore:
    """At most :attr:`limit` permits of :attr:`name` at once: ``async with
    sem.acquire(ttl=...) as permit:``. Made by ``backend.semaphore(name, limit)``; cheap,
    no I/O, reusable and safe to share between tasks."""

    def __init__(self, holds: Holds, store: PermitStore) -> None:
        self._holds = holds
        self._store = store
        self.name = store.name
        self.limit = store.limit
        #: The name of each permit's lease (see :data:`LEASE_PREFIX`).
        self.lease_name = LEASE_PREFIX + store.name

    def __repr__(self) -> str:
        return f"<asynclock Semaphore {self.name!r} limit={self.limit}>"

    async def holders(self) -> list[Holder]:
        """Every live permit of :attr:`name` as the server sees it, by slot, whatever limit
        it was granted under (this semaphore's is not checked): an
        :class:`~asynclock.Holder` each, with ``kind="permit"``, ``slot``, ``limit`` (the
        server's), ``owner``, ``label``, ``token`` (the slot's) and ``remaining``. A
        snapshot for operators, as ``backend.holder()``: what ``asynclock holder NAME``
        shows. NotImplementedError where the backend cannot list them."""
        acq = self._holds._acq.ready()
        found = await acq.call("holders", self._store.holders(), (NotImplementedError,))
        return cast("list[Holder]", found)

    def acquire(
        self,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> PermitHold:
        """``async with sem.acquire(ttl=10) as permit:`` — a permit for the body, as
        ``backend.lock()`` holds a lock: ``ttl`` renewed by the backend, ``timeout`` (None:
        wait for ever) and ``blocking`` (False: ``LockHeld`` at once when every permit is
        held; a wait that runs out raises ``AcquireTimeout``), ``max_hold``. Arguments are
        checked here."""
        args = check_lock_args(self.lease_name, ttl, timeout, blocking, max_hold)
        return PermitHold(self, args[1], args[2], args[3], args[4])


class PermitHold(AsyncContextOnly):
    """``async with sem.acquire(ttl=...) as permit:`` (one entry per object)."""

    _usage = "semaphore.acquire(ttl=...)"

    def __init__(
        self,
        sem: Semaphore,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
    ) -> None:
        self._sem = sem
        self._args = (ttl, timeout, blocking, max_hold)
        self._permit: Permit | None = None

    async def __aenter__(self) -> Permit:
        if self._permit is not None:
            raise RuntimeError("a permit's `async with` is entered once; call acquire() again")
        sem = self._sem
        holds = sem._holds
        ttl, timeout, blocking, max_hold = self._args
        lease = await holds.acquire(
            sem.lease_name, ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
        )
        self._permit = permit = Permit(sem, lease, sem._store.slot_of(lease.owner))
        try:
            holds.enter(self, lease)  # LeaseLost, the body never runs, if already lost
        except BaseException:
            await holds.release(lease, quiet=True)
            raise
        return permit

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        permit = self._permit
        assert permit is not None, "PermitHold.__aexit__ without __aenter__"
        holds = self._sem._holds
        try:
            return holds.exit(self, exc_info, ended=False)
        finally:
            # Shielded and bounded; owner-checked at the server; a no-op if released in the
            # body already or lost (the server frees a lost permit by its ttl).
            await holds.release(permit.lease, quiet=True)


class Permit(LeaseHeld):
    """One permit of a semaphore: :attr:`slot`, :attr:`token`, :attr:`name`,
    :attr:`lost`, :attr:`lease` (the permit's lease: ``force_loss`` takes the permit)."""

    __slots__ = ("_sem", "lease", "slot", "token")

    def __init__(self, sem: Semaphore, lease: Lease, slot: int) -> None:
        self._sem = sem
        #: The permit's lease (renewed by the backend).
        self.lease = lease
        #: Which of the ``limit`` permits this is (0 .. limit-1): distinct among live permits.
        self.slot = slot
        #: Strictly greater than every token granted before for this slot of the name.
        self.token: int = lease.token

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.lease.released else "held"
        return f"<Permit {self.name!r} slot={self.slot} token={self.token} {state}>"

    @property
    def name(self) -> str:
        return self._sem.name

    @property
    def limit(self) -> int:
        return self._sem.limit

    async def release(self) -> bool:
        """Give the permit back now (owner-checked): True if it was ours and freed; False
        if it was released or lost already. The block's exit then does nothing more."""
        return await self._sem._holds.release(self.lease)
