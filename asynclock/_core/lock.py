"""Lock: ``async with backend.lock(name, ttl=...)``, the per-task lease stack (context.py)
and the argument checks every hold makes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .context import LEASES as _LEASES
from .context import LockBody, refuse_nested
from .exceptions import LeaseLost
from .lease import Lease
from .misuse import AsyncContextOnly
from .templates import NameTemplate
from .validation import check_lock_args, check_scope

if TYPE_CHECKING:
    from .acquisition import Acquisition

T = TypeVar("T")
P = ParamSpec("P")


class Lock(LockBody, AsyncContextOnly):
    """``async with backend.lock(name, ttl=...) as lease:`` — see :meth:`Backend.lock`.

    Reusable and safe to share: each entering task gets its own lease (ownership lives on
    the lease, per task; never in thread-locals).
    """

    __slots__ = ("_acq", "_args", "_call", "_token_scope")
    _acq: Acquisition
    _usage = "backend.lock(...)"
    #: What it says of itself in ``AlreadyHeld`` (``context.refuse_nested``).
    kind = "lock"

    def __init__(
        self,
        acq: Acquisition,
        name: str,
        ttl: float,
        timeout: float | None,
        blocking: bool,
        max_hold: float | None,
        token_scope: str | None = None,
        *,
        internal: bool = False,
        template: str | None = None,
    ) -> None:
        self._acq = acq
        # internal: a name in asynclock's own namespace (an idempotency key's hold).
        self._args = check_lock_args(name, ttl, timeout, blocking, max_hold, internal=internal)
        self._token_scope = None if token_scope is None else check_scope(token_scope)
        #: acquire()'s arguments up to the holder: owner_tag "" (a lock's owner is
        #: untagged), then the name template the lock was made from (``locked_function``),
        #: for observers.
        self._call = (*self._args, "", self._token_scope, template)

    @property
    def name(self) -> str:
        return self._args[0]

    def __repr__(self) -> str:
        return f"<asynclock.Lock {self.name!r} ttl={self._args[1]:g}>"

    # __aenter__ and __aexit__ (context.LockBody's) are not coroutines themselves: each
    # makes its checks and returns the acquisition's coroutine, which enters (leaves) the
    # holder scope too. That is a coroutine layer less per acquire and per release, a
    # measurable share of a fast hold (see benchmarks/README.md, "Core overhead").

    def __aenter__(self) -> Coroutine[Any, Any, Lease]:
        acq = self._acq
        task = acq.current_task()  # None: not on the loop that opened the backend
        if task is None and acq.open:
            acq.wrong_loop()
        stack = _LEASES.get()
        if stack:
            refuse_nested(acq, self._args[0], stack, task)
        return acq.acquire(*self._call, (self, task, stack))


def locked_function(
    lock: Callable[..., Lock],
    name: str,
    lock_args: tuple[float, float | None, bool, float | None],
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """:meth:`Backend.locked_function` (see there): ``lock`` is the backend's ``lock``;
    ``lock_args``: ttl, timeout, blocking, max_hold."""
    ttl, timeout, blocking, max_hold = lock_args
    template = NameTemplate(name)
    # The lock arguments are checked now, not at the first call.
    check_lock_args("name", ttl, timeout, blocking, max_hold)

    def decorate(func: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        if not inspect.iscoroutinefunction(func):
            kind = "an async generator" if inspect.isasyncgenfunction(func) else "not async"
            raise TypeError(
                f"locked_function needs an `async def` function; "
                f"{getattr(func, '__qualname__', func)!s} is {kind} (for sync code, hold "
                "the lock around the call with `async with backend.lock(...)`)"
            )
        template.check_callable(func)
        signature = inspect.signature(func)

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> T:
            lock_name = template.format_call(func, args, kwargs)
            call_lock = lock(
                lock_name,
                ttl=ttl,
                timeout=timeout,
                blocking=blocking,
                max_hold=max_hold,
                template=template.template,
            )
            async with call_lock as lease:
                return await func(*args, **kwargs)
            # Only a lost lease's cancellation is swallowed, and then __aexit__ raises.
            raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost")

        locked_call.__signature__ = signature  # type: ignore[attr-defined]
        return locked_call

    return decorate
