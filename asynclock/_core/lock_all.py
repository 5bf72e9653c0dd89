"""``backend.lock_all(names, ttl=...)``: several names held all or nothing, for one body.

* The names are taken one at a time in one canonical order, sorted (Python's ``str``
  order, by code point: the same in every process), so two callers taking overlapping sets
  in opposite orders never deadlock (each waits only for names after the ones it holds:
  redisson#1160). Duplicates, an empty set, a str in place of a list and more than
  :data:`MAX_NAMES` names are refused when ``lock_all()`` is called.
* Every name is acquired exactly as ``lock()`` acquires it (``Acquisition.acquire``:
  waited for, an interrupted attempt cleaned up, G6). If any one fails (busy with
  ``blocking=False``, the timeout, an error, a cancellation, a lease taken already lost
  meanwhile) every lease taken so far is released, shielded, before the error propagates:
  nothing is left held. ``timeout`` bounds the whole acquisition, not each name.
* The body runs in one holder scope shared by all the leases (``context.enter_group``):
  the loss of any one cancels it, every lease is released, and the ``async with`` raises
  :class:`LeaseLost` naming the lease lost first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio

from .context import (
    LEASES,
    ExcInfo,
    enter_group,
    leave_group,
    lost_on_exit,
    refuse_nested,
    watch_while_acquiring,
)
from .exceptions import AcquireTimeout
from .lease import Lease
from .misuse import AsyncContextOnly
from .validation import check_lock_args, check_name, check_not_reserved

if TYPE_CHECKING:
    from .acquisition import Acquisition

#: The most names one ``lock_all()`` takes. Each is a server round trip to take and one to
#: give back, one after the other: more than this is a design that wants one coarser lock.
MAX_NAMES = 1000


def check_names(names: object) -> tuple[str, ...]:
    """``names`` checked and in canonical (sorted) order, or an error saying what is allowed."""
    if isinstance(names, str | bytes | bytearray):
        raise TypeError(
            f"lock_all() takes a list of lock names, not a single {type(names).__name__} "
            f"({names[:40]!r}): write lock_all([{names[:40]!r}]) or use lock(name) for one name"
        )
    if not isinstance(names, Iterable):
        raise TypeError(
            f"lock_all() takes a list (or other iterable) of lock names, not {type(names).__name__}"
        )
    taken = list(itertools.islice(names, MAX_NAMES + 1))
    if not taken:
        raise ValueError(f"lock_all() needs at least one lock name (1 to {MAX_NAMES})")
    if len(taken) > MAX_NAMES:
        raise ValueError(
            f"lock_all() takes at most {MAX_NAMES} names, got more; hold one coarser lock "
            "for a set that large"
        )
    for index, name in enumerate(taken):
        if not isinstance(name, str):
            raise TypeError(
                f"lock_all() names must all be str, but names[{index}] is "
                f"{type(name).__name__} ({name!r:.40})"
            )
        check_not_reserved(check_name(name))
    ordered = tuple(sorted(taken))
    for first, second in itertools.pairwise(ordered):
        if first == second:
            raise ValueError(
                f"lock_all() names must be distinct, but {first!r} appears more than once"
            )
    return ordered


class HeldLocks(Mapping[str, Lease]):
    """What ``async with backend.lock_all(names, ...)`` yields: a read-only mapping from
    each name to its :class:`~asynclock.Lease` (``held["a"].token`` is the fencing token
    for ``"a"``), iterated in canonical (sorted) order, which is the order they were taken.
    """

    __slots__ = ("_by_name", "leases")

    def __init__(self, leases: Sequence[Lease]) -> None:
        #: The leases, in canonical (sorted by name) order.
        self.leases: tuple[Lease, ...] = tuple(leases)
        self._by_name = {lease.name: lease for lease in self.leases}

    def __getitem__(self, name: str) -> Lease:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self.leases)

    def __repr__(self) -> str:
        tokens = ", ".join(f"{lease.name!r}: {lease.token}" for lease in self.leases)
        return f"<asynclock.HeldLocks {{{tokens}}}>"

    @property
    def tokens(self) -> dict[str, int]:
        """Each name's fencing token."""
        return {lease.name: lease.token for lease in self.leases}

    def check(self) -> None:
        """:meth:`Lease.check <asynclock.Lease.check>` for every lease: raise
        :class:`~asynclock.LeaseLost` if any one is lost or past its local deadline."""
        for lease in self.leases:
            lease.check()


class LockAll(AsyncContextOnly):
    """``async with backend.lock_all(names, ttl=...) as held:`` holds every one of ``names``
    for the body, or none: ``held`` is a :class:`HeldLocks` (``held["a"].token``).

    The names are taken one at a time in sorted order, whatever order they are given in, so
    two callers taking overlapping sets never deadlock. If any one is not acquired (busy
    with ``blocking=False``: :class:`~asynclock.LockHeld`; not all within ``timeout``, which
    bounds the whole acquisition: :class:`~asynclock.AcquireTimeout`; an error; a
    cancellation; a lease taken already lost meanwhile: :class:`~asynclock.LeaseLost`),
    the leases taken so far are released before the error propagates. The body is
    cancelled when any one lease is lost; every lease is then released and the
    ``async with`` raises :class:`~asynclock.LeaseLost` naming the one lost. ``ttl`` and
    ``max_hold`` apply to each lease (``max_hold`` counts from each name's grant, so the
    first name taken bounds the hold). Inside the body :func:`~asynclock.current_lease` is
    the last name's lease.

    ``names``: a list (any iterable but a str) of 1 to :data:`MAX_NAMES` (1,000) distinct
    lock names; anything else is a TypeError or ValueError at the call. Reusable and safe
    to share, as a :class:`~asynclock.Lock` is: each entering task gets its own leases.
    """

    __slots__ = ("_acq", "_args", "names")
    _usage = "backend.lock_all(...)"
    #: What it says of itself in ``AlreadyHeld`` (``context.refuse_nested``).
    kind = "lock_all"

    def __init__(
        self,
        acq: Acquisition,
        names: Iterable[str],
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
    ) -> None:
        self._acq = acq
        #: The names, in the order they are taken (sorted).
        self.names = check_names(names)
        _, ttl_s, timeout_s, blocking, hold = check_lock_args(
            self.names[0], ttl, timeout, blocking, max_hold
        )
        self._args = (ttl_s, timeout_s, blocking, hold)

    def __repr__(self) -> str:
        return f"<asynclock.LockAll {len(self.names)} names ttl={self._args[0]:g}>"

    async def __aenter__(self) -> HeldLocks:
        acq = self._acq.ready()
        task = acq.current_task()
        stack = LEASES.get()
        if stack:  # a name this task holds already: it would wait for itself
            for name in self.names:
                refuse_nested(acq, name, stack, task)
        leases = await self._acquire_all(acq)
        try:
            enter_group(self, leases, task, acq.scope_type(), LEASES.get())
        except BaseException:  # one was lost (or past its deadline) before the body began
            await release_all(acq, leases)
            raise
        return HeldLocks(leases)

    async def _acquire_all(self, acq: Acquisition) -> list[Lease]:
        """Every name's lease, taken in order; on any failure none (all released)."""
        ttl, timeout, blocking, max_hold = self._args
        clock = acq.clock
        give_up_at = None if timeout is None else clock.now() + timeout
        leases: list[Lease] = []
        # A loss of a lease taken already cancels the acquisition of the rest.
        watching = acq.scope_type()
        try:
            with watching:
                for name in self.names:
                    left = None if give_up_at is None else max(0.0, give_up_at - clock.now())
                    try:
                        lease = await acq.acquire(name, ttl, left, blocking, max_hold)
                    except AcquireTimeout as exc:
                        assert timeout is not None
                        raise AcquireTimeout(name, timeout, self._gave_up(name, exc)) from None
                    leases.append(lease)
                    watch_while_acquiring((lease,), watching)
        except BaseException:
            watch_while_acquiring(leases, None)
            await release_all(acq, leases)
            raise
        watch_while_acquiring(leases, None)
        lost = next((lease for lease in leases if lease.lost.reason is not None), None)
        if lost is not None:  # (only a loss cancels `watching`)
            await release_all(acq, leases)
            lost.check()  # raises LeaseLost, naming it and why
        return leases

    def _gave_up(self, name: str, exc: AcquireTimeout) -> str:
        taken = self.names.index(name)
        why = f"lock_all() of {len(self.names)} names"
        if taken:
            why += f"; the names taken before it ({taken}) were released"
        return f"{why}; {exc.detail}" if exc.detail else why

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        leases, scope = leave_group(self)
        assert scope is not None
        lost = next((lease for lease in leases if lease.lost.reason is not None), None)
        try:
            swallowed = bool(scope.__exit__(*exc_info))
        finally:
            await release_all(self._acq, leases)
        if lost is None:  # none lost during the body; the release may have found one ended
            lost = next((lease for lease in leases if lease.lost.reason is not None), None)
        if lost is not None:
            return lost_on_exit(lost, swallowed, exc_info[0])
        return swallowed


async def release_all(acq: Acquisition, leases: Sequence[Lease]) -> None:
    """Give back every lease, last taken first, shielded (each release bounded by the
    backend's ``release_timeout``); an unconfirmed one expires at the server within its ttl."""
    with anyio.CancelScope(shield=True):
        for lease in reversed(leases):
            await acq.release(lease, quiet=True)


class LocksAll:
    """``Backend.lock_all`` (a mixin of the backend: it keeps backend.py small)."""

    _acq: Acquisition

    def lock_all(
        self,
        names: Iterable[str],
        *,
        ttl: float,
        timeout: float | None = None,
        blocking: bool = True,
        max_hold: float | None = None,
    ) -> LockAll:
        """All of ``names`` or none, for one body: see :class:`~asynclock.LockAll`."""
        return LockAll(self._acq, names, ttl, timeout, blocking, max_hold)
