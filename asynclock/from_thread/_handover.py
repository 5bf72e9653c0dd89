"""One lease for one synchronous body: the hand-over between its thread and the loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio

from .._core.acquisition import Acquisition
from .._core.backend import Backend, thread_grants
from .._core.lease import Lease
from ._body import ExcInfo, GuardedBody
from ._guard import BodyGuard
from ._loop import LoopThread

logger = logging.getLogger("asynclock")
T = TypeVar("T")


class Exchange:
    """The hand-over between a body's thread and one task on the loop, one lock wide: the
    body's thread posts a step and waits on the lock; the loop does the step and releases
    it. Each step is one wake-up of each thread (a coroutine submitted and a future per
    step, plus a watcher task, cost a Celery run about a fifth more CPU).

    The loop's task waits for the body's end in :meth:`until_end`, stopping the body with
    :attr:`guard` (set by the body's thread before the body starts) if the lease is lost
    meanwhile. A body's thread that gives up waiting (a time limit, a shutdown) ends the
    task's step at once (:meth:`_end_now`)."""

    __slots__ = ("_ended", "_loop", "_ready", "_scope", "error", "gave_up", "guard")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Held by the body's thread; the loop releases it when a step is done.
        self._ready = threading.Lock()
        self._ready.acquire()
        self._ended = False
        self._scope: anyio.CancelScope | None = None
        #: The body's thread gave up waiting for the loop.
        self.gave_up = False
        #: What went wrong on the loop (the body's thread raises it).
        self.error: BaseException | None = None
        #: Set by the body's thread before the body starts; stopped on loss.
        self.guard: BodyGuard | None = None

    # -- the body's thread

    def _post_and_wait(self, step: Callable[..., object], *args: object) -> None:
        self._loop.call_soon_threadsafe(step, *args)
        try:
            self._ready.acquire()
        except BaseException:
            # Interrupted while waiting: stop waiting for the loop; whatever it gets after
            # all (a lease) is given back instead of being held for the process's life.
            self._loop.call_soon_threadsafe(self._give_up)
            raise

    def _end(self) -> None:
        """Post the body's end and wait for the loop to finish the hold."""
        self._loop.call_soon_threadsafe(self._end_now)
        self._ready.acquire()

    def finish(self, error: BaseException | None) -> None:
        """The body is over (``error``: how it ended): give the lease back."""
        raise NotImplementedError

    # -- the loop's side

    def _give_up(self) -> None:
        self.gave_up = True
        self._end_now()

    def _end_now(self) -> None:
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    def _signal(self) -> None:
        if self._ready.locked():  # unlocked if the body's thread gave up waiting
            self._ready.release()

    def _scoped(self, *, shield: bool = False) -> anyio.CancelScope:
        """A scope for the task's current step, cancelled when the body ends (or its thread
        gives up); ``shield``: by nothing else."""
        scope = self._scope = anyio.CancelScope(shield=shield)
        if self._ended:
            scope.cancel()
        return scope

    async def until_end(self, lease: Lease, *, shield: bool = False) -> None:
        """Until the body's thread posts the end; if ``lease`` is lost meanwhile, stop the
        body (before it starts, ``BodyGuard.enter`` sees the loss)."""
        with self._scoped(shield=shield):
            self._signal()  # the body may start
            await lease.lost.wait()
            if self.guard is not None:
                self.guard.stop()
            await anyio.sleep_forever()

    def _on_lost(self) -> None:
        """On the loop: the lease granted in the body's thread was lost."""
        if self.guard is not None:
            self.guard.stop()


class Handover(Exchange):
    """One body's lease: taken, watched and given back by one task on the loop thread (or,
    on one Redis server, taken and given back by the body's thread itself)."""

    __slots__ = ("_direct", "lease")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.lease: Lease | None = None
        #: The acquisition whose blocking calls granted :attr:`lease` in the body's thread
        #: (None: the loop granted it, in a task that holds it).
        self._direct: Acquisition | None = None

    # -- the body's thread

    def begin(
        self,
        backend: Backend,
        name: str,
        *,
        ttl: float,
        blocking: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Acquire: :attr:`lease`, or :attr:`error`.

        First, where the backend's driver has blocking calls (one Redis server), one
        attempt right here in the body's thread: no hand-over at all, the loop is only told
        (without waiting) to renew and watch the lease. Otherwise, or if that attempt did
        not get the name, post the acquisition to the loop and wait for its outcome.
        """
        acq = thread_grants(backend)
        post = self._loop.call_soon_threadsafe
        lease = acq.thread_acquire(name, ttl, post, self._on_lost)
        if lease is not None:
            self.lease, self._direct = lease, acq
            return
        self._post_and_wait(self._start, backend, name, (ttl, blocking, timeout))

    def finish(self, error: BaseException | None) -> None:
        self.end()

    def end(self) -> None:
        """The body is over: release (when it returns, the server has answered)."""
        if self._direct is not None:
            assert self.lease is not None
            self._direct.thread_release(self.lease)
            return
        self._end()

    # -- the loop's side

    def _start(self, backend: Backend, name: str, args: tuple[float, bool, float | None]) -> None:
        self._loop.create_task(self._run(backend, name, *args))

    async def _run(
        self, backend: Backend, name: str, ttl: float, blocking: bool, timeout: float | None
    ) -> None:
        lease: Lease | None = None
        try:
            with self._scoped():  # cancelled if the body's thread gave up
                lease = await backend.acquire(name, ttl=ttl, blocking=blocking, timeout=timeout)
        except BaseException as exc:
            self.error = exc
            self._signal()
            if not isinstance(exc, Exception):
                raise
            return
        if lease is None:  # cancelled while waiting: nobody is there to be told
            return
        self.lease = lease
        try:
            await self.until_end(lease)
        finally:
            try:
                await lease.release()  # a no-op that says so if the lease was lost
            except Exception as exc:
                logger.warning("release of %r failed (it expires by its ttl): %r", name, exc)
            finally:
                self._signal()


class Hold:
    """What :func:`hold` returns: ``with`` it around the body."""

    __slots__ = ("_args", "_body", "_handover")

    def __init__(self, thread: LoopThread, target: str | Backend, name: str, *args: Any) -> None:
        self._args = (thread, target, name, *args)
        self._handover: Handover | None = None
        self._body: GuardedBody | None = None

    def __enter__(self) -> Lease:
        thread, target, name, ttl, blocking, timeout = self._args
        handover = self._handover = Handover(thread.loop)
        handover.begin(thread.backend(target), name, ttl=ttl, blocking=blocking, timeout=timeout)
        if handover.error is not None:
            raise handover.error
        lease = handover.lease
        assert lease is not None
        self._body = guarded(handover, lease)
        return lease

    def __exit__(self, *exc_info: *ExcInfo) -> None:
        assert self._handover is not None and self._body is not None, "exit without enter"
        try:
            self._body.__exit__(*exc_info)
        finally:
            self._handover.end()


def guarded(exchange: Exchange, lease: Lease) -> GuardedBody:
    """The body under ``lease`` entered, guarded by a :class:`BodyGuard` the exchange's loop
    side stops; a lease lost already is LeaseLost here, after the exchange is finished."""
    body = GuardedBody(lease, BodyGuard(lease))
    exchange.guard = body._guard
    try:
        body.__enter__()
    except BaseException as exc:
        exchange.finish(exc)
        raise
    return body


def hold(
    thread: LoopThread,
    target: str | Backend,
    name: str,
    *,
    ttl: float,
    blocking: bool = True,
    timeout: float | None = None,
) -> Hold:
    """Hold ``name`` on ``thread``'s backend for ``target`` around a synchronous body.

    ``with hold(thread, "redis://…", "report:7", ttl=10) as lease:`` acquires (as
    ``backend.acquire``: ``LockHeld``, ``AcquireTimeout``, ``RestartGrace`` …), makes the
    lease :func:`asynclock.current_lease` in the body, stops the body with ``LeaseLost``
    if the lease is lost (the block then raises ``LeaseLost`` even if the body swallowed
    it), and releases when the body is over. A coroutine body (run on this thread's own
    ``asyncio.Runner``) goes through ``guard(lease, thread.loop).run(runner, fn)``, which
    cancels it instead.
    """
    return Hold(thread, target, name, ttl, blocking, timeout)


# -- deprecated (asynclock.from_thread's names before the four) -------------------------------


class Guarded(Protocol):
    """What :func:`run_body` tells whose loop side watches the lease (deprecated)."""

    guard: BodyGuard | None


def run_body(
    body: Callable[[], T], lease: Lease, handover: Guarded
) -> tuple[T | None, BaseException | None]:
    """Run ``body`` in this thread under ``lease`` (deprecated: ``with hold(...)``).
    Returns ``(result, error)``; a body that lost its lease returns ``(None, LeaseLost)``."""
    guard = handover.guard = BodyGuard(lease)
    try:
        with GuardedBody(lease, guard):
            return body(), None
    except BaseException as exc:
        return None, exc
