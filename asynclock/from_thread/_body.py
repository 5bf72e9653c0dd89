"""A body under a lease: the one guarded-body sequence, and :func:`guard` for a body that
runs elsewhere than the loop holding its lease (a pool's thread, another event loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TypeVar, cast

import anyio

from .._core.context import use_lease
from .._core.exceptions import LeaseLost
from .._core.lease import Lease
from ._guard import AsyncLeaseLost, BodyGuard, _active, lost_error, stop_on_loss

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
T = TypeVar("T")


class GuardedBody:
    """The one guarded-body sequence: ``with GuardedBody(lease, guard):`` around a body
    under ``lease``, stopped by ``guard`` (made for it in its thread; interrupted from the
    loop by :meth:`BodyGuard.stop`). LeaseLost at once if the lease is lost already; the
    lease is :func:`asynclock.current_lease` inside; a loss during the body, or found as it
    ends (a thawed thread can return before the loss reached it), is the block's
    ``LeaseLost``, with the body's own error as its cause, even if the body swallowed the
    interruption: what it did was done without the lock. (A class, not a generator: it is
    on every Celery run's path.)"""

    __slots__ = ("_guard", "_lease", "_use")

    def __init__(self, lease: Lease, guard: BodyGuard) -> None:
        self._lease = lease
        self._guard = guard
        self._use: AbstractContextManager[Lease] | None = None

    def __enter__(self) -> None:
        guard = self._guard
        try:
            guard.enter()
            use = use_lease(self._lease)
            use.__enter__()
        except BaseException:
            guard.leave()
            raise
        self._use = use

    def __exit__(self, *exc_info: *ExcInfo) -> None:
        error = exc_info[1]
        try:
            if self._use is not None:
                self._use.__exit__(None, None, None)
            lost = lost_error(self._lease)  # read as the body ends: a loss after it is no fault
        finally:
            self._guard.leave()
        if lost is not None:
            if isinstance(error, AsyncLeaseLost):
                raise lost from None  # the interruption itself, as a plain LeaseLost
            if not isinstance(error, LeaseLost):
                raise lost from error


class Guard:
    """What :func:`guard` returns: ``with`` for a body in this thread, ``async with`` for a
    coroutine in this task (on an event loop other than the lease's), :meth:`run` for a
    coroutine this thread runs on its own runner."""

    __slots__ = ("_body", "_loop", "_scope", "_watch", "lease")

    def __init__(self, lease: Lease, loop: asyncio.AbstractEventLoop) -> None:
        if not isinstance(lease, Lease):
            raise TypeError(f"guard() takes an asynclock Lease, not {type(lease).__name__}")
        if not isinstance(loop, asyncio.AbstractEventLoop):
            raise TypeError(
                "guard() takes the event loop the lease's backend runs on (LoopThread.loop), "
                f"not {type(loop).__name__}"
            )
        self.lease = lease
        self._loop = loop
        self._watch: concurrent.futures.Future[None] | None = None
        self._scope: anyio.CancelScope | None = None
        self._body: GuardedBody | None = None

    def _start(self, guard: BodyGuard) -> None:
        # A guard inside a hold of the same lease (a coroutine under Celery's hold) is
        # stopped through that hold's watcher (BodyGuard.interrupt): no second one.
        watched = any(g.lease is self.lease and g.active for g in _active.get(guard.thread_id, ()))
        body = GuardedBody(self.lease, guard)
        body.__enter__()  # LeaseLost here if the lease is lost already
        self._body = body
        if not watched:
            self._watch = asyncio.run_coroutine_threadsafe(
                stop_on_loss(self.lease, guard), self._loop
            )

    def _end(self, *exc_info: *ExcInfo) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()  # nothing reaches the body once it has left (BodyGuard.leave)
        body, self._body = self._body, None
        assert body is not None, "guard() exited without being entered"
        body.__exit__(*exc_info)

    # -- a body in this thread

    def __enter__(self) -> Lease:
        self._start(BodyGuard(self.lease))
        return self.lease

    def __exit__(self, *exc_info: *ExcInfo) -> None:
        self._end(*exc_info)

    # -- a coroutine in this task, on an event loop of its own

    async def __aenter__(self) -> Lease:
        body_loop = asyncio.get_running_loop()
        scope = anyio.CancelScope()
        scope.__enter__()
        try:
            self._start(BodyGuard(self.lease, lambda: body_loop.call_soon_threadsafe(scope.cancel)))
        except BaseException as exc:
            scope.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._scope = scope
        return self.lease

    async def __aexit__(self, *exc_info: *ExcInfo) -> None:
        scope, self._scope = self._scope, None
        assert scope is not None, "guard() exited without being entered"
        try:
            quiet = scope.__exit__(*exc_info)
        except BaseException as err:
            self._end(type(err), err, err.__traceback__)
            raise
        if quiet:
            # Only the loss cancels the scope, which ends its own cancellation quietly:
            # the body's sequence raises LeaseLost for it.
            self._end(None, None, None)
            raise AssertionError("unreachable: a guard is cancelled only when its lease is lost")
        self._end(*exc_info)

    # -- a coroutine run from this thread on its own runner

    def run(self, runner: asyncio.Runner, fn: Callable[[], Awaitable[T]]) -> T:
        """``runner.run(fn())``, cancelled on loss: the block's ``LeaseLost``. The guard is
        active before the runner's loop starts, so a loss at any moment (also under a
        :func:`hold` on this thread, which then cancels this coroutine instead of
        interrupting the thread) reaches the coroutine, never the loop's machinery."""
        body_loop = runner.get_loop()
        state = _Run()

        def cancel() -> None:  # on the runner's loop, whenever it next runs (this run or
            state.cancelled = True  # a later one: then it finds this run's scope exited)
            if state.scope is not None:
                state.scope.cancel()

        async def main() -> T | None:
            # The runner's tasks run in its own context: the lease is made current there.
            with anyio.CancelScope() as scope, use_lease(self.lease):
                state.scope = scope
                if state.cancelled:
                    scope.cancel()
                return await fn()
            return None  # cancelled: the guard's exit raises LeaseLost

        self._start(BodyGuard(self.lease, lambda: body_loop.call_soon_threadsafe(cancel)))
        try:
            result = runner.run(main())
        except BaseException as exc:
            self._end(type(exc), exc, exc.__traceback__)
            raise
        self._end(None, None, None)  # LeaseLost if the lease was lost
        return cast(T, result)


class _Run:
    __slots__ = ("cancelled", "scope")

    def __init__(self) -> None:
        self.cancelled = False
        self.scope: anyio.CancelScope | None = None


def guard(lease: Lease, loop: asyncio.AbstractEventLoop) -> Guard:
    """Stop a body that runs outside the loop holding ``lease`` when the lease is lost.

    ``loop`` is the event loop the lease's backend runs on (:attr:`LoopThread.loop`, or the
    loop a scheduler holds its claims on). For a body run by another pool:

    * ``with guard(lease, loop):`` in the body's thread (a thread pool's job): the body is
      interrupted with ``LeaseLost``, as in :func:`hold` (a signal on the main thread, an
      async exception on any other);
    * ``async with guard(lease, loop):`` in a coroutine on another event loop (a job on a
      scheduler's loop): it is cancelled;
    * ``guard(lease, loop).run(runner, fn)``: ``fn()``, a coroutine function, on this
      thread's own ``asyncio.Runner``, cancelled. Inside a :func:`hold` or
      :func:`idempotent` block of the same thread, this is how a coroutine body is run
      (Celery's async tasks): the hold then cancels it instead of interrupting the
      thread, which would raise inside the runner's loop and leave its task behind.

    Either way the lease is :func:`asynclock.current_lease` inside, a lease lost already is
    ``LeaseLost`` at once, and the block raises ``LeaseLost`` if the lease was lost during
    the body or by its end, even if the body caught the interruption. It neither renews nor
    releases the lease: whoever holds it does.
    """
    return Guard(lease, loop)
