"""The current lease: which lease the running task (or thread) works under.

One context variable keeps the stack of leases of the current context, innermost last.
``backend.lock()`` pushes its lease onto it for its body, and integrations push the lease a task
run, request or job works under with :func:`use_lease` (e.g. in the thread a sync Celery
task body runs on), so user code finds its token the same way everywhere.
A context variable is per task (child tasks get a copy) and per thread, never shared.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .exceptions import AlreadyHeld, LeaseLost

if TYPE_CHECKING:
    from .lease import Lease

#: One entry of the lease stack: (who pushed it, the lease, the holder's cancel scope or
#: None). The pusher is the hold that entered (a ``Lock``, a leadership ``Term``, a claim,
#: a permit: it pops its own entry) or a ``use_lease()`` marker object.
Entry = tuple[object, "Lease", "anyio.CancelScope | None"]
#: The lease stack of this context, innermost last.
LEASES: ContextVar[tuple[Entry, ...]] = ContextVar("asynclock_leases", default=())
#: What ``__aexit__`` is called with: ``async def __aexit__(self, *exc_info: *ExcInfo)``.
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def enter_body(
    pusher: object,
    lease: Lease,
    task: object,
    scope: anyio.CancelScope,
    stack: tuple[Entry, ...],
    *,
    start_cancelled: bool = False,
) -> None:
    """Start the body of a hold of ``lease`` (any kind: a lock, a term, a claim, a permit):
    ``pusher`` is what entered it (it leaves with :func:`leave_body`), ``task`` the running
    task, ``scope`` a new cancel scope of the running loop, ``stack`` this context's lease
    stack. A lease lost, released or past its local deadline raises :class:`LeaseLost`
    here, before any of the body runs (a cancelled scope would let the body run up to its
    first suspension: a statement written to a socket before it). Otherwise ``scope`` is
    entered as the lease's holder scope (the session cancels it on a loss) and the entry
    pushed. ``start_cancelled``: for a body whose exit swallows the loss (a leadership
    term in ``async for``), enter a lost lease's scope cancelled instead of raising.
    """
    if lease.lost.reason is None and not lease._released:
        now = lease._grantor.clock.now()
        hard = lease.hard_deadline
        if now < lease._deadline and (hard is None or now < hard):
            scope.__enter__()
            lease._scope = scope
            lease._task = task
            LEASES.set(stack + ((pusher, lease, scope),))  # noqa: RUF005 (no list: cheaper)
            return
    if not start_cancelled:
        lease.check()  # raises LeaseLost, with the reason
        raise AssertionError("unreachable: the lease is live")  # pragma: no cover
    scope.__enter__()
    scope.cancel()
    lease._scope = scope
    lease._task = task
    LEASES.set(stack + ((pusher, lease, scope),))  # noqa: RUF005 (no list: cheaper)


def leave_body(pusher: object) -> Entry:
    """End ``pusher``'s body: its entry off the lease stack (usually the top one: holds end
    in the order they began), the lease's holder scope and task unset; the entry is
    returned, its scope not yet left."""
    stack = LEASES.get()
    if stack and stack[-1][0] is pusher:
        LEASES.set(stack[:-1])
        entry = stack[-1]
    else:
        found = pop_lease(pusher)
        if found is None:
            raise AssertionError(f"{pusher!r}: __aexit__ without __aenter__")
        entry = found
    lease = entry[1]
    lease._scope = None
    lease._task = None  # the hold is over (and a kept lease must not keep its task)
    return entry


def enter_group(
    pusher: object,
    leases: Sequence[Lease],
    task: object,
    scope: anyio.CancelScope,
    stack: tuple[Entry, ...],
) -> None:
    """:func:`enter_body` for one body holding several leases at once (``lock_all``): one
    holder scope for all of them, so the loss of any one cancels the body; LeaseLost,
    before any of the body runs, if any one is lost, released or past its deadline. Each
    lease is pushed (the last is :func:`current_lease`); :func:`leave_group` ends it."""
    for lease in leases:
        if lease.lost.reason is not None or lease._released:
            lease.check()
        now = lease._grantor.clock.now()
        if now >= lease.deadline:
            lease.check()
    scope.__enter__()
    for lease in leases:
        lease._scope = scope
        lease._task = task
        if lease.lost.reason is not None:  # lost meanwhile (no await since the check)
            scope.cancel()
    LEASES.set(stack + tuple((pusher, lease, scope) for lease in leases))


def leave_group(pusher: object) -> tuple[list[Lease], anyio.CancelScope | None]:
    """End ``pusher``'s group body: its entries off the stack, each lease's holder scope
    and task unset; returns the leases and their (not yet left) scope. Only the innermost
    group (the entries that share the innermost entry's scope): a child task started in a
    body of the same pusher (a shared ``lock_all``) inherits that body's entries."""
    stack = LEASES.get()
    scope = next((entry[2] for entry in reversed(stack) if entry[0] is pusher), None)
    mine = [entry for entry in stack if entry[0] is pusher and entry[2] is scope]
    if not mine:
        raise AssertionError(f"{pusher!r}: __aexit__ without __aenter__")
    LEASES.set(tuple(entry for entry in stack if not (entry[0] is pusher and entry[2] is scope)))
    for _, lease, _ in mine:
        lease._scope = None
        lease._task = None
    return [entry[1] for entry in mine], mine[0][2]


def watch_while_acquiring(leases: Sequence[Lease], scope: anyio.CancelScope | None) -> None:
    """Make ``scope`` the holder scope of ``leases`` before their body begins (``lock_all``
    sets the scope of the acquisition of the remaining names: a loss of a lease taken
    already cancels it); None unsets it again."""
    for lease in leases:
        lease._scope = scope


def pop_lease(pusher: object) -> Entry | None:
    """Take ``pusher``'s innermost entry off this context's lease stack (usually the top
    one: holds end in the order they began) and return it; None if it has none."""
    stack = LEASES.get()
    if stack and stack[-1][0] is pusher:
        LEASES.set(stack[:-1])
        return stack[-1]
    for index in range(len(stack) - 2, -1, -1):
        if stack[index][0] is pusher:
            LEASES.set(stack[:index] + stack[index + 1 :])
            return stack[index]
    return None


def current_lease() -> Lease:
    """The innermost lease held by the current task, thread or context.

    Set inside ``async with backend.lock(...)``, inside :func:`use_lease`, and by every
    asynclock integration for the task run, request or job it guards.

    Raises:
        LookupError: no lease is held here.
    """
    stack = LEASES.get()
    if not stack:
        raise LookupError(
            "no asynclock lease is held in this context: call current_lease() inside "
            "`async with backend.lock(...)`, a guarded task/request/job, or use_lease()"
        )
    return stack[-1][1]


@contextmanager
def use_lease(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` the :func:`current_lease` of this context for the ``with`` body.

    For code that holds a lease in one place and runs the work in another (a worker
    thread, a callback): it sets no cancel scope and does not renew or release anything.
    """
    from .lease import Lease

    if not isinstance(lease, Lease):
        raise TypeError(f"use_lease() takes an asynclock Lease, not {type(lease).__name__}")
    marker = object()
    LEASES.set((*LEASES.get(), (marker, lease, None)))
    try:
        yield lease
    finally:
        pop_lease(marker)


def refuse_nested(grantor: object, name: str, stack: tuple[Entry, ...], task: object) -> None:
    """Raise :class:`AlreadyHeld` if this task holds ``name`` from ``grantor`` already: it
    is inside ``async with backend.lock(name)`` or a leadership term of ``name``. Every way
    to ask for a name (``lock``, ``acquire``, ``leadership``) calls it first: asking again
    would wait for itself forever.

    ``stack`` is this context's lease stack. A child task starts with a copy of its
    parent's, so an entry counts only while its lease is live and only in the task that
    entered it.
    """
    for pusher, lease, _ in stack:
        if (
            lease.name == name
            and lease._grantor is grantor
            and lease._task == task  # tasks compare by identity; a fallback id by value
            and task is not None
            and not lease._released
            and not lease.lost
        ):
            # The outermost entry of a lease is the hold that entered it (use_lease()
            # markers come later, inside); it says what it is.
            raise AlreadyHeld(name, lease.token, getattr(pusher, "kind", "lock"))


def lost_on_exit(lease: Lease, swallowed: bool, exc_type: type[BaseException] | None) -> bool:
    """What leaving the ``async with`` of a lost lease does (G4): raise :class:`LeaseLost`
    when the body ended by the loss's cancellation (``swallowed``) or without an error;
    otherwise return False, so the body's own error propagates."""
    if swallowed or exc_type is None:
        raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost") from None
    return False


class Releaser(Protocol):
    """What a lock's exit releases through (the acquisition, ``release.Releasing``)."""

    def release(
        self,
        lease: Lease,
        quiet: bool = False,
        scope: anyio.CancelScope | None = None,
        exiting: ExcInfo | None = None,
    ) -> Coroutine[Any, Any, bool]: ...


class LockBody:
    """The end of a lock's body (``Lock.__aexit__``), here with the rest of the holder
    scope's life (a base of ``lock.Lock``): :func:`leave_body` written out inline, then the
    release. Not a coroutine itself: it returns the release's coroutine, which leaves the
    holder scope too, a coroutine layer (and a call) less per hold."""

    __slots__ = ()
    _acq: Releaser

    def __aexit__(self, *exc_info: *ExcInfo) -> Coroutine[Any, Any, bool]:
        stack = LEASES.get()
        if stack and (entry := stack[-1])[0] is self:  # leave_body's usual case, inline
            LEASES.set(stack[:-1])
        else:
            found = pop_lease(self)
            assert found is not None, "Lock.__aexit__ without __aenter__"
            entry = found
        _, lease, scope = entry
        lease._scope = None
        lease._task = None  # the hold is over (and a kept lease must not keep its task)
        assert scope is not None  # a lock's own entry always carries its scope
        if lease.lost.reason is not None:
            # Lost: its scope was cancelled (only a loss cancels a holder scope:
            # Session.lose, or the push of a lease already lost; this test is
            # `scope.cancel_called` without the property call).
            return self._exit_cancelled(lease, scope, exc_info)
        # The usual case: release inside the holder's own scope, shielded from outer
        # cancellation from here on — one cancel scope per hold, not two. Nothing can
        # cancel this scope now but the release deadline: the lease leaves the renewer and
        # watchdog (the session's `held`) first thing in `release`, and `_scope` is unset.
        scope.shield = True
        return self._acq.release(lease, True, scope, exc_info)  # quiet, scope, exiting

    async def _exit_cancelled(
        self, lease: Lease, scope: anyio.CancelScope, exc_info: ExcInfo
    ) -> bool:
        """Lost: leave the cancelled scope, then release in a fresh shielded one."""
        try:
            swallowed = bool(scope.__exit__(*exc_info))
        finally:
            await self._acq.release(lease, quiet=True)
        if lease.lost.reason is not None:
            return lost_on_exit(lease, swallowed, exc_info[0])
        return swallowed
