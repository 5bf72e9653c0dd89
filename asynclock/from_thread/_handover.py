"""One lease for one synchronous body: the hand-over between its thread and the loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import anyio

from .._core.acquisition import Acquisition
from .._core.backend import Backend
from .._core.context import use_lease
from .._core.exceptions import LeaseLost
from .._core.lease import Lease
from ._guard import RESEND, BodyGuard, lost_error, stop_on_loss
from ._loop import LoopThread

logger = logging.getLogger("asynclock")
T = TypeVar("T")


class Handover:
    """One body's lease: taken, watched and given back by one task on the loop thread.

    The body's thread and the loop hand over with one lock, each step one wake-up: the
    body's thread posts :meth:`begin` (acquire) and waits; the loop signals the grant (or
    the error) and watches the lease, interrupting :attr:`guard` when it is lost; the body's
    thread posts :meth:`end` when the body is over and waits; the loop releases
    (owner-checked) and signals. (It replaced a submitted coroutine and a future per step
    plus a watcher task, and cut the CPU a lock adds to a Celery run by about a fifth.)
    """

    __slots__ = (
        "_direct",
        "_finished",
        "_loop",
        "_ready",
        "_scope",
        "_task",
        "error",
        "guard",
        "lease",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Held by the body's thread; the loop releases it at the grant and at the end.
        self._ready = threading.Lock()
        self._ready.acquire()
        self._finished = False
        self._scope: anyio.CancelScope | None = None
        self._task: asyncio.Task[None] | None = None
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        #: Set by the body's thread before the body starts; interrupted on loss.
        self.guard: BodyGuard | None = None
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
        acq = backend._acq
        post = self._loop.call_soon_threadsafe
        lease = acq.thread_acquire(name, ttl, post, self._lost)
        if lease is not None:
            self.lease, self._direct = lease, acq
            return
        post(self._start, backend, name, (ttl, blocking, timeout))
        try:
            self._ready.acquire()
        except BaseException:
            # Interrupted while waiting (a time limit, a shutdown): stop waiting for the
            # lock; if it is granted after all, give it back instead of renewing it for the
            # process's life.
            self._loop.call_soon_threadsafe(self._finish)
            raise

    def end(self) -> None:
        """The body is over: release (when it returns, the server has answered)."""
        if self._direct is not None:
            assert self.lease is not None
            self._direct.thread_release(self.lease)
            return
        self._loop.call_soon_threadsafe(self._finish)
        self._ready.acquire()

    # -- the loop's side

    def _start(self, backend: Backend, name: str, args: tuple[float, bool, float | None]) -> None:
        self._task = self._loop.create_task(self._run(backend, name, *args))

    def _lost(self) -> None:
        """On the loop: the lease granted in the body's thread was lost (as
        :func:`stop_on_loss`, from a callback: a signal is sent again every
        :data:`RESEND` seconds until its handler has raised)."""
        guard = self.guard
        if guard is None:
            return  # the body has not started: BodyGuard.enter() checks the lease
        guard.interrupt()
        if guard.undelivered():
            self._loop.call_later(RESEND, self._lost)

    def _finish(self) -> None:
        self._finished = True
        if self._scope is not None:
            self._scope.cancel()

    def _signal(self) -> None:
        if self._ready.locked():  # unlocked if the body's thread gave up waiting
            self._ready.release()

    async def _run(
        self, backend: Backend, name: str, ttl: float, blocking: bool, timeout: float | None
    ) -> None:
        lease: Lease | None = None
        try:
            with anyio.CancelScope() as scope:  # cancelled by _finish: the thread gave up
                self._scope = scope
                if self._finished:
                    scope.cancel()
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
            with anyio.CancelScope() as scope:  # cancelled by _finish
                self._scope = scope
                if self._finished:
                    scope.cancel()
                self._signal()  # the body may start
                await lease.lost.wait()
                if self.guard is not None:  # else the body has not started: enter() checks
                    await stop_on_loss(lease, self.guard)
                await anyio.sleep_forever()  # until the body is over
        finally:
            try:
                await lease.release()  # a no-op that says so if the lease was lost
            except Exception as exc:
                logger.warning("release of %r failed (it expires by its ttl): %r", name, exc)
            finally:
                self._signal()


class Guarded(Protocol):
    """What :func:`run_body` tells whose loop side watches the lease: a :class:`Handover`,
    or an integration's own hand-over (asynclock_celery's idempotent runs)."""

    guard: BodyGuard | None


def run_body(
    body: Callable[[], T], lease: Lease, handover: Guarded
) -> tuple[T | None, BaseException | None]:
    """Run ``body`` in this thread under ``lease`` (its :func:`asynclock.current_lease`),
    stopped with ``LeaseLost`` when the lease is lost (``handover.guard`` is set to the
    :class:`BodyGuard` that the loop side interrupts). Returns ``(result, error)``: a body
    that was interrupted, swallowed the interruption, or ran past its lease returns
    ``(None, LeaseLost)``, since whatever it did was done without the lock."""
    guard = handover.guard = BodyGuard(lease)
    result: T | None = None
    error: BaseException | None = None
    lost: LeaseLost | None = None
    try:
        try:
            guard.enter()
            with use_lease(lease):
                result = body()
        finally:
            lost = lost_error(lease)  # read as the body ends: a loss after it is no fault
            guard.leave()
    except LeaseLost as exc:
        error = exc
        lost = lost or lost_error(lease)
    except BaseException as exc:
        error = exc
    if lost is not None:
        lost.__cause__ = error if error is not None and error is not lost else None
        return None, lost
    return result, error


@contextmanager
def hold(
    thread: LoopThread,
    target: str | Backend,
    name: str,
    *,
    ttl: float,
    blocking: bool = True,
    timeout: float | None = None,
) -> Iterator[Lease]:
    """Hold ``name`` on ``thread``'s backend for ``target`` around a synchronous body.

    ``with hold(thread, "redis://…", "report:7", ttl=10) as lease:`` acquires (as
    ``backend.acquire``: ``LockHeld``, ``AcquireTimeout``, ``RestartGrace`` …), makes the
    lease :func:`asynclock.current_lease` in the body, stops the body with ``LeaseLost``
    if the lease is lost (the block then raises ``LeaseLost`` even if the body swallowed
    it), and releases when the body is over.
    """
    handover = Handover(thread.loop)
    handover.begin(thread.backend(target), name, ttl=ttl, blocking=blocking, timeout=timeout)
    if handover.error is not None:
        raise handover.error
    lease = handover.lease
    assert lease is not None
    guard = handover.guard = BodyGuard(lease)
    error: BaseException | None = None
    try:
        guard.enter()
        try:
            with use_lease(lease):
                yield lease
        except BaseException as exc:
            error = exc
            raise
        finally:
            lost = lost_error(lease)
            guard.leave()
            if lost is not None and not isinstance(error, LeaseLost):
                lost.__cause__ = error
                raise lost
    finally:
        handover.end()
