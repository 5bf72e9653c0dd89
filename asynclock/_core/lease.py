"""A lease, the server's grant of a name: owner, token, ttl, local deadline, loss signal.

The lease protocol: every field has one writer. A ``Lease`` is made only by
:meth:`Session.new_lease <asynclock._core.session.Session.new_lease>` (its ``__init__``
refuses), and afterwards:

==============================  ====================================================
field                           written by
==============================  ====================================================
``name owner token acquired_at  ``Session.new_lease`` (once)
hard_deadline _grantor
_keeper``
``ttl``, ``_deadline``          the session: ``new_lease``, each renewal, ``extend``
``lost``                        the session: made by ``new_lease``, set by ``lose``
``_released``                   the session: ``new_lease`` (False), ``finish`` (True)
``_scope``, ``_task``           ``context``: ``enter_body`` / ``leave_body`` (every kind
                                of hold: lock, leadership term, claim, permit, ...);
                                ``new_lease`` starts them at None
==============================  ====================================================

``tests/test_lease_protocol.py`` reads the package and fails on a write anywhere else.

Every kind of hold goes through the same session: a lock's lease is granted by
``acquire`` (``Acquisition``); a lease granted by a feature's own server step (a claimed
row, a semaphore permit, a partition) is adopted through :class:`~asynclock._core.holds.Holds`.
Either way the session renews it through its :class:`~asynclock._core.driver.Keeper`,
loses it (``Session.lose``) and finishes it (``Session.finish``), so loss, stats, hold
times, advice, observers and ``asynclock.testing.force_loss`` need no feature code.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .clock import Clock
from .exceptions import LeaseLost

if TYPE_CHECKING:
    from .keeper import Keeper


class Grantor(Protocol):
    """What a lease's own methods go through: the acquisition for a lock, a feature's
    ``Holds`` for the rest (both on the backend's loop)."""

    @property
    def clock(self) -> Clock: ...

    def current_task(self) -> object: ...

    def check_loop(self) -> None: ...

    async def release(self, lease: Lease, *, quiet: bool = False) -> bool: ...

    async def let_expire(self, lease: Lease) -> bool: ...

    async def extend(self, lease: Lease, ttl: object) -> None: ...

    def lose(self, lease: Lease, reason: str) -> None: ...


class LossSignal:
    """Set once when the lease is lost. ``await lease.lost`` waits for it; ``bool()`` peeks."""

    __slots__ = ("_event", "_on_set", "reason")

    #: Called on the loop when set (unset on most leases: see :meth:`_set`).
    _on_set: Callable[[], object] | None

    def __init__(self) -> None:
        self._event: anyio.Event | None = None  # made on first wait: most leases never lose
        self.reason: str | None = None

    def is_set(self) -> bool:
        return self.reason is not None

    def __bool__(self) -> bool:
        return self.reason is not None

    async def wait(self) -> str:
        """Wait until the lease is lost and return the reason."""
        if self.reason is None:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        assert self.reason is not None
        return self.reason

    def __await__(self) -> Generator[Any, None, str]:
        return self.wait().__await__()

    def _set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            if self._event is not None:
                self._event.set()
            # A callback instead of a waiting task (a lease granted to another thread,
            # see Acquisition.thread_acquire); unset on most leases.
            on_set: Callable[[], object] | None = getattr(self, "_on_set", None)
            if on_set is not None:
                on_set()


class Lease:
    """One grant of a lock name, live until released or lost.

    Use ``token`` as the fencing token for every write the lock protects. ``lost`` is set
    (and the holder's ``async with`` body cancelled) as soon as the lease may have ended.
    """

    __slots__ = (
        "__weakref__",
        "_deadline",
        "_grantor",
        "_keeper",
        "_released",
        "_scope",
        "_task",
        "acquired_at",
        "hard_deadline",
        "lost",
        "name",
        "owner",
        "token",
        "ttl",
    )

    # Its fields (see the module's table of who writes each). Session.new_lease makes every
    # lease and sets each one: a Lease has no working __init__.
    name: str
    owner: str
    token: int
    ttl: float
    acquired_at: float
    #: ``acquired_at + max_hold``; past it the lease is given up (None: no bound).
    hard_deadline: float | None
    lost: LossSignal
    #: The renewable local deadline (G3); :attr:`deadline` also heeds ``hard_deadline``.
    _deadline: float
    #: What granted it: release, extend and let_expire go through it.
    _grantor: Grantor
    #: The server side of its kind of hold: renews and releases it (the driver, for a lock).
    _keeper: Keeper
    #: The holder's cancel scope while inside ``async with backend.lock(...)``.
    _scope: anyio.CancelScope | None
    #: The task that entered ``async with backend.lock(...)`` (None for acquire()).
    _task: object
    _released: bool

    def __init__(self) -> None:
        raise TypeError(
            "a Lease is granted by a backend: `async with backend.lock(...)` or "
            "`await backend.acquire(...)`"
        )

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<Lease {self.name!r} token={self.token} {state} remaining={self.remaining():.3f}s>"

    @property
    def deadline(self) -> float:
        """Local deadline on the backend's clock: earlier than the server could expire us."""
        if self.hard_deadline is not None:
            return min(self._deadline, self.hard_deadline)
        return self._deadline

    @property
    def released(self) -> bool:
        return self._released

    def remaining(self) -> float:
        """Seconds until the local deadline (0 once lost or released)."""
        if self.lost or self._released:
            return 0.0
        return max(0.0, self.deadline - self._grantor.clock.now())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease is lost or its local deadline has passed.

        Call it right before an unfenced side effect; it reads the clock, so it is correct
        even when the event loop was frozen and the watchdog has not run yet.
        """
        if self.lost:
            raise LeaseLost(self.name, self.token, self.lost.reason or "lost")
        if self._released:
            raise LeaseLost(self.name, self.token, "released")
        now = self._grantor.clock.now()
        if now >= self.deadline:
            hard = self.hard_deadline is not None and now >= self.hard_deadline
            reason = "max_hold reached" if hard else "local deadline passed"
            raise LeaseLost(self.name, self.token, reason)

    async def release(self) -> bool:
        """Release now (shielded, bounded by the backend's ``release_timeout``).

        Returns True if released; False if the lease was already lost or released (a
        reported no-op). Raises :class:`~asynclock.BackendUnavailable` if the server could
        not confirm the release; the lease is unchanged, so you may call it again (renewal
        has stopped either way, so the server expires it within its ttl).
        """
        grantor = self._grantor
        grantor.check_loop()
        return await grantor.release(self)

    async def let_expire(self) -> bool:
        """Stop renewing without releasing: the server keeps the lease one more full ttl.

        For a claim that must keep others out for a while after the work is done (a job
        occurrence a late node must not run again). It extends the lease once more (so
        nobody can take the name for ``ttl`` seconds from now), then forgets it locally;
        afterwards it counts as released. Returns True if that last extension was
        confirmed; False if the lease was already lost or released, or the server did not
        answer (it then expires within its ttl from the last renewal).
        """
        self._grantor.check_loop()
        return await self._grantor.let_expire(self)

    async def extend(self, ttl: float) -> None:
        """Change this lease's ttl now; the heartbeat carries on with the new one.

        The server extends the lease by ``ttl`` from now, owner-checked (G5), and the local
        deadline is recomputed from the moment the request was sent (G3); a shorter ttl
        moves it earlier. The backend's renewer sends it at once, in its one round trip.

        Raises:
            TypeError, ValueError: ``ttl`` is not a number of seconds > 0 and at most
                :data:`asynclock.MAX_TTL` (before any I/O).
            LeaseLost: the lease is lost or released, or the server refused the extend; a
                refusal also loses the lease (its ``async with`` body is cancelled).
            BackendUnavailable: the server did not answer; the lease keeps its old ttl
                (and, for a shorter ttl, a deadline as if the server had taken it).
        """
        self._grantor.check_loop()
        await self._grantor.extend(self, ttl)


def deadline_reason(lease: Lease, now: float) -> str:
    """Why a lease whose :attr:`Lease.deadline` has passed is lost."""
    hard = lease.hard_deadline is not None and now >= lease.hard_deadline
    return "max_hold reached" if hard else "local deadline passed"
