"""Read-write locks: many readers or one writer of a name per server, each hold a lease of
the session; a write hold's token is a strictly increasing **writer epoch**, a read hold's
the epoch of the last write (docs/rwlocks.md).

Built as semaphores are (``_core/semaphore.py``), on the session's hook for leases granted
outside ``acquire`` (:class:`~.holds.Holds`); the server's part is an
:class:`~.rw_store.RWStore` (one per backend: ``driver.rwlock_store``). A hold:

* is acquired, waited for (woken by a release, or polled, as a permit: not FIFO; a
  waiting writer's intent blocks new readers, so writers are never starved by readers)
  and cleaned up
  after an interrupted attempt exactly as a lock is (``Holds.acquire``): busy with
  ``blocking=False`` raises ``LockHeld``, a timeout ``AcquireTimeout``;
* is a lease of the session (named ``rwlock:<name>``, both modes): renewed with the
  store's other holds of its mode in one call per round, lost when a renewal is refused or
  its local deadline passes, counted in ``stats()``, told to observers, reachable by
  ``asynclock.testing.force_loss``;
* ``async with rw.read(ttl=...) as r:`` / ``rw.write(...)`` runs the body in a cancel
  scope cancelled when the hold is lost (then the block raises ``LeaseLost``; a hold lost
  before the body begins raises there, and the body never runs); the block's exit gives
  the hold back, owner-checked: releasing twice never frees another holder's hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .context import ExcInfo
from .holder import Holder
from .holds import Holds, LeaseHeld
from .lease import Lease
from .misuse import AsyncContextOnly
from .rw_store import LEASE_PREFIX, READ, WRITE, RWStore
from .validation import check_lock_args, check_name, check_not_reserved

if TYPE_CHECKING:
    from .acquisition import Acquisition
    from .driver import Driver

__all__ = ("LEASE_PREFIX", "RWHold", "RWLock", "RWLocks")


class RWLocks:
    """``Backend.rwlock`` (a mixin of the backend: it keeps backend.py small)."""

    _acq: Acquisition
    driver: Driver

    def rwlock(self, name: str) -> RWLock:
        """A read-write lock: ``async with backend.rwlock("catalog").read(ttl=30) as r:``
        shares ``name`` with other readers, ``.write(ttl=30) as w:`` holds it alone.
        ``w.token`` is the writer epoch (strictly increasing per name); ``r.token`` is the
        epoch of the last write. A waiting writer blocks new readers (writer preference).
        A name's rwlock is independent of its lock and its semaphore (separate
        namespaces). NotImplementedError on a backend without rwlocks yet (the message
        names those that have them). See docs/rwlocks.md."""
        checked = check_name(name)
        check_not_reserved(checked)
        return RWLock(self._acq, self.driver.rwlock_store(checked))


class RWLock:
    """Readers share :attr:`name`, a writer holds it alone: ``async with
    rw.read(ttl=...) as r:`` / ``async with rw.write(ttl=...) as w:``. Made by
    ``backend.rwlock(name)``; cheap, no I/O, reusable and safe to share between tasks."""

    def __init__(self, acq: Acquisition, store: RWStore) -> None:
        self._acq = acq
        self._store = store
        self._holds = {
            READ: Holds(acq, store.reads, "read hold"),
            WRITE: Holds(acq, store.writes, "write hold"),
        }
        self.name = store.name
        #: The name of each hold's lease, read or write (see :data:`LEASE_PREFIX`).
        self.lease_name = LEASE_PREFIX + store.name

    def __repr__(self) -> str:
        return f"<asynclock RWLock {self.name!r}>"

    async def holders(self) -> list[Holder]:
        """Who holds :attr:`name` now as the server sees it: the writer
        (``kind="write"``, ``token`` its writer epoch), the readers (``"read"``, ``token``
        the epoch they read) and the writers waiting (``"intent"``: they keep new readers
        out; no token), each an :class:`~asynclock.Holder` with ``owner``, ``label`` and
        ``remaining``. A snapshot for operators, as ``backend.holder()``: what
        ``asynclock holder NAME`` shows. NotImplementedError where the backend cannot
        list them."""
        acq = self._acq.ready()
        found = await acq.call("holders", self._store.holders(), (NotImplementedError,))
        return cast("list[Holder]", found)

    def read(
        self,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> RWAcquire:
        """``async with rw.read(ttl=10) as r:`` — a shared hold for the body, as
        ``backend.lock()`` holds a lock: ``ttl`` renewed by the backend, ``timeout`` (None:
        wait for ever) and ``blocking`` (False: ``LockHeld`` at once while a writer holds
        the lock or waits for it; a wait that runs out raises ``AcquireTimeout``),
        ``max_hold``. Arguments are checked here."""
        return self._hold(READ, ttl, timeout, blocking, max_hold)

    def write(
        self,
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> RWAcquire:
        """``async with rw.write(ttl=10) as w:`` — the exclusive hold (no reader, no other
        writer), with a new writer epoch ``w.token``; arguments as :meth:`read`. While it
        waits, its intent (renewed by the wait, expiring ``ttl`` seconds after its last
        attempt) keeps new readers out."""
        return self._hold(WRITE, ttl, timeout, blocking, max_hold)

    def _hold(
        self,
        mode: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
    ) -> RWAcquire:
        args = check_lock_args(self.lease_name, ttl, timeout, blocking, max_hold)
        return RWAcquire(self, mode, args[1], args[2], args[3], args[4])


class RWAcquire(AsyncContextOnly):
    """``async with rw.read(ttl=...) as r:`` / ``rw.write(...)`` (one entry per object)."""

    _usage = "rwlock.read(ttl=...) or rwlock.write(ttl=...)"

    def __init__(
        self,
        rw: RWLock,
        mode: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
    ) -> None:
        self._rw = rw
        self._mode = mode
        self._args = (ttl, timeout, blocking, max_hold)
        self._hold: RWHold | None = None

    async def __aenter__(self) -> RWHold:
        if self._hold is not None:
            raise RuntimeError("a read or write hold's `async with` is entered once; call again")
        rw, mode = self._rw, self._mode
        holds = rw._holds[mode]
        ttl, timeout, blocking, max_hold = self._args
        lease = await holds.acquire(
            rw.lease_name, ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
        )
        self._hold = hold = RWHold(rw, mode, lease)
        try:
            holds.enter(self, lease)  # LeaseLost, the body never runs, if already lost
        except BaseException:
            await holds.release(lease, quiet=True)
            raise
        return hold

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        hold = self._hold
        assert hold is not None, "RWAcquire.__aexit__ without __aenter__"
        holds = self._rw._holds[self._mode]
        try:
            return holds.exit(self, exc_info, ended=False)
        finally:
            # Shielded and bounded; owner-checked at the server; a no-op if released in the
            # body already or lost (the server frees a lost hold by its ttl).
            await holds.release(hold.lease, quiet=True)


class RWHold(LeaseHeld):
    """One read or write hold of a read-write lock: :attr:`mode` (``"read"`` or
    ``"write"``), :attr:`token` (the writer epoch), :attr:`name`, :attr:`lost`,
    :attr:`lease` (the hold's lease: ``force_loss`` takes the hold)."""

    __slots__ = ("_rw", "lease", "mode", "token")

    def __init__(self, rw: RWLock, mode: str, lease: Lease) -> None:
        self._rw = rw
        #: ``"read"`` or ``"write"``.
        self.mode = "read" if mode == READ else "write"
        #: The hold's lease (renewed by the backend).
        self.lease = lease
        #: A write hold: the new writer epoch, strictly greater than every earlier write
        #: hold's of the name. A read hold: the epoch of the last write granted before it.
        self.token: int = lease.token

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.lease.released else "held"
        return f"<RWHold {self.name!r} {self.mode} token={self.token} {state}>"

    @property
    def name(self) -> str:
        return self._rw.name

    async def release(self) -> bool:
        """Give the hold back now (owner-checked): True if it was ours and freed; False if
        it was released or lost already. The block's exit then does nothing more."""
        return await self._rw._holds[READ if self.mode == "read" else WRITE].release(self.lease)
