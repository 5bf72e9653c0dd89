"""The current lease: which lease the running task (or thread) works under.

One context variable keeps the stack of leases of the current context, innermost last.
``backend.lock()`` pushes its lease onto it for its body, and integrations push the lease a task
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

#: One entry of the lease stack: (who pushed it, the lease, the holder's cancel scope or
#: None). The pusher is the ``Lock`` or leadership ``Term`` that entered (it pops its own
#: entry) or a ``use_lease()`` marker object.
Entry = tuple[object, "Lease", "anyio.CancelScope | None"]
#: The lease stack of this context, innermost last.
LEASES: ContextVar[tuple[Entry, ...]] = ContextVar("asynclock_leases", default=())
#: What ``__aexit__`` is called with: ``async def __aexit__(self, *exc_info: *ExcInfo)``.
ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


def push_lease(
    pusher: object, lease: Lease, scope: anyio.CancelScope, stack: tuple[Entry, ...]
) -> None:
    """Enter ``scope`` as ``lease``'s holder scope (cancelled at once if the lease is
    already lost) and push ``pusher``'s entry onto ``stack``, this context's lease stack."""
    scope.__enter__()
    lease._scope = scope
    if lease.lost.reason is not None:
        scope.cancel()
    LEASES.set((*stack, (pusher, lease, scope)))


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
