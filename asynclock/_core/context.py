"""The current lease: which lease the running task (or thread) works under.

One context variable holds the stack of holds of the current context, innermost last.
``backend.lock()`` pushes onto it for its body, and integrations push the lease a task
run, request or job works under with :func:`use_lease` (e.g. in the thread a sync Celery
task body runs on), so user code finds its token the same way everywhere.
A context variable is per task (child tasks get a copy) and per thread, never shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from .lease import Lease

#: (who pushed it, the lease, the holder's cancel scope or None), innermost last. The
#: first item is the ``Lock`` that entered (it pops its own entry) or a marker object.
Hold = tuple[object, "Lease", "anyio.CancelScope | None"]
HOLDS: ContextVar[tuple[Hold, ...]] = ContextVar("asynclock_holds", default=())
#: What ``__aexit__`` is called with: ``async def __aexit__(self, *exc_info: *ExcInfo)``.
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def push_hold(
    holder: object, lease: Lease, scope: anyio.CancelScope, holds: tuple[Hold, ...]
) -> None:
    """Enter ``scope`` as ``lease``'s holder scope (cancelled at once if the lease is
    already lost) and push the hold onto ``holds``, this context's stack."""
    scope.__enter__()
    lease._scope = scope
    if lease.lost.reason is not None:
        scope.cancel()
    HOLDS.set((*holds, (holder, lease, scope)))


def pop_hold(holder: object) -> Hold | None:
    """Take ``holder``'s innermost hold off this context's stack (usually the top one:
    holds end in the order they began) and return it; None if it has none."""
    holds = HOLDS.get()
    if holds and holds[-1][0] is holder:
        HOLDS.set(holds[:-1])
        return holds[-1]
    for index in range(len(holds) - 2, -1, -1):
        if holds[index][0] is holder:
            HOLDS.set(holds[:index] + holds[index + 1 :])
            return holds[index]
    return None


def current_lease() -> Lease:
    """The innermost lease held by the current task, thread or context.

    Set inside ``async with backend.lock(...)``, inside :func:`use_lease`, and by every
    asynclock integration for the task run, request or job it guards.

    Raises:
        LookupError: no lease is held here.
    """
    holds = HOLDS.get()
    if not holds:
        raise LookupError(
            "no asynclock lease is held in this context: call current_lease() inside "
            "`async with backend.lock(...)`, a guarded task/request/job, or use_lease()"
        )
    return holds[-1][1]


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
    HOLDS.set((*HOLDS.get(), (marker, lease, None)))
    try:
        yield lease
    finally:
        pop_hold(marker)
