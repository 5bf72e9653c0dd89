"""Lock: ``async with backend.lock(name, ttl=...)``, the per-task lease stack (context.py)
and the argument checks every hold makes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio

from .context import LEASES as _LEASES
from .context import ExcInfo, pop_lease
from .exceptions import AlreadyHeld, LeaseLost
from .lease import Lease
from .misuse import AsyncContextOnly
from .templates import NameTemplate
from .validation import (
    MAX_NAME_BYTES,
    MAX_TTL,
    check_lease_ttl,
    check_name,
    check_not_reserved,
    check_timeout,
    check_ttl,
)

if TYPE_CHECKING:
    from .acquisition import Acquisition

T = TypeVar("T")
P = ParamSpec("P")


def _check_scope(scope: object) -> str:
    if not isinstance(scope, str):
        raise TypeError(f"token_scope must be a str or None, not {type(scope).__name__}")
    try:
        return check_name(scope)
    except ValueError as exc:
        raise ValueError(f"token_scope: {exc} (it is validated like a lock name)") from None


def _check_lock_args(
    name: object,
    ttl: object,
    timeout: object,
    blocking: object,
    max_hold: object,
    *,
    internal: bool = False,
) -> tuple[str, float, float | None, bool, float | None]:
    # Fast path for the usual call, `backend.lock(name, ttl=...)` (made on every hold).
    if (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_BYTES // 4
        and name.isascii()
        and name[0] != "\x00"  # RESERVED_PREFIX: the slow path decides
        and (type(ttl) is float or type(ttl) is int)
        and 0 < ttl <= MAX_TTL
        and timeout is None
        and blocking is True
        and max_hold is None
    ):
        return name, float(ttl), None, True, None
    name = check_name(name)
    if not internal:
        check_not_reserved(name)
    ttl_f = check_lease_ttl(ttl)
    timeout_f = check_timeout(timeout)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, not {type(blocking).__name__}")
    if not blocking and timeout_f is not None:
        raise ValueError("timeout only applies to blocking=True; pass one or the other")
    hold = None if max_hold is None else check_ttl(max_hold, what="max_hold")
    return name, ttl_f, timeout_f, blocking, hold


def _refuse_nested(acq: Acquisition, name: str, stack: tuple[Any, ...], task: object) -> None:
    """Raise :class:`AlreadyHeld` if this task holds ``name`` on this backend already: it is
    inside ``async with backend.lock(name)`` or a leadership term of ``name``. Every way to
    ask for a name (``lock``, ``acquire``, ``leadership``) calls it first: asking again
    would wait for itself forever.

    ``stack`` is this context's lease stack. A child task starts with a copy of its
    parent's, so an entry counts only while its lease is live and only in the task that
    entered it.
    """
    for pusher, lease, _ in stack:
        if (
            lease.name == name
            and lease._grantor is acq
            and lease._task == task  # tasks compare by identity; a fallback id by value
            and task is not None
            and not lease._released
            and not lease.lost
        ):
            # The outermost entry of a lease is the Lock or the leadership Term that
            # entered it (use_lease() markers come later, inside).
            outer = "lock" if isinstance(pusher, Lock) else "leadership"
            raise AlreadyHeld(name, lease.token, outer)


class Lock(AsyncContextOnly):
    """``async with backend.lock(name, ttl=...) as lease:`` — see :meth:`Backend.lock`.

    Reusable and safe to share: each entering task gets its own lease (ownership lives on
    the lease, per task; never in thread-locals).
    """

    # _template: the NameTemplate text a lock of locked_function was made from (set there
    # only, after __init__: no cost to other locks), for telemetry (observer.py).
    __slots__ = ("_acq", "_args", "_call", "_template", "_token_scope")
    _template: str
    _usage = "backend.lock(...)"

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
    ) -> None:
        self._acq = acq
        # internal: a name in asynclock's own namespace (an idempotency key's hold).
        self._args = _check_lock_args(name, ttl, timeout, blocking, max_hold, internal=internal)
        self._token_scope = None if token_scope is None else _check_scope(token_scope)
        #: acquire()'s arguments but the last (owner_tag "": a lock's owner is untagged).
        self._call = (*self._args, "", self._token_scope)

    @property
    def name(self) -> str:
        return self._args[0]

    def __repr__(self) -> str:
        return f"<asynclock.Lock {self.name!r} ttl={self._args[1]:g}>"

    # __aenter__ and __aexit__ are not coroutines themselves: each makes its checks and
    # returns the acquisition's coroutine, which enters (leaves) the holder scope too.
    # That is a coroutine layer less per acquire and per release, a measurable share of a
    # fast hold (see benchmarks/README.md, "Core overhead").

    def __aenter__(self) -> Coroutine[Any, Any, Lease]:
        acq = self._acq
        task = acq.current_task()  # None: not on the loop that opened the backend
        if task is None and acq.open:
            acq.wrong_loop()
        stack = _LEASES.get()
        if stack:
            _refuse_nested(acq, self._args[0], stack, task)
        return acq.acquire(*self._call, (self, task, stack))

    def __aexit__(self, *exc_info: *ExcInfo) -> Coroutine[Any, Any, bool]:
        stack = _LEASES.get()
        try:
            pusher, lease, scope = stack[-1]
        except IndexError:
            raise AssertionError("Lock.__aexit__ without __aenter__") from None
        if pusher is self:  # pop_lease's usual case, inline
            _LEASES.set(stack[:-1])
        else:
            entry = pop_lease(self)
            assert entry is not None, "Lock.__aexit__ without __aenter__"
            _, lease, scope = entry
        lease._scope = None
        lease._task = None  # the hold is over (and a kept lease must not keep its task)
        assert scope is not None  # a Lock's own entry always carries its scope
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


def lost_on_exit(lease: Lease, swallowed: bool, exc_type: type[BaseException] | None) -> bool:
    """What leaving the ``async with`` of a lost lease does (G4): raise :class:`LeaseLost`
    when the body ended by the loss's cancellation (``swallowed``) or without an error;
    otherwise return False, so the body's own error propagates."""
    if swallowed or exc_type is None:
        raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost") from None
    return False


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
    _check_lock_args("name", ttl, timeout, blocking, max_hold)

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
                lock_name, ttl=ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
            )
            call_lock._template = template.template
            async with call_lock as lease:
                return await func(*args, **kwargs)
            # Only a lost lease's cancellation is swallowed, and then __aexit__ raises.
            raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost")

        locked_call.__signature__ = signature  # type: ignore[attr-defined]
        return locked_call

    return decorate
