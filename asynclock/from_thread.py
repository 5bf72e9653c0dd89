"""Synchronous code that holds asynclock leases (the bridge every sync integration uses).

A backend lives on an event loop; a synchronous body (a Celery task, an APScheduler job in
a thread pool, a script) runs on a thread of its own. This module is the bridge:

* :class:`LoopThread` — one asyncio event loop on a background thread, and the backends
  open on it (opened at first use, closed, releasing what they hold, by :meth:`close`).
  Calls cross with ``asyncio.run_coroutine_threadsafe``: one hop per call (anyio's
  blocking portal costs two or three per task start, measured as a third of a no-op
  Celery task's throughput).
* :class:`Handover` — one lease for one body: the body's thread asks for it and waits; the
  loop acquires it, watches it, and releases it when the body is over. Each step is one
  wake-up of a lock both threads share.
* :class:`BodyGuard` — stops the body when the lease is lost: ``LeaseLost`` is raised in
  the body's thread. On the main thread by a signal (``SIGUSR2``), whose handler raises
  it: it interrupts ``time.sleep``, ``Event.wait``, ``socket.recv``, ``subprocess.run`` and
  pure-Python loops (PEP 475). On any other thread by ``PyThreadState_SetAsyncExc``, at the
  thread's next bytecode: it cannot interrupt a blocking system call (the exception waits
  until the call returns). For a body that runs as a coroutine on another loop, a
  ``cancel`` callback instead.
* :func:`hold` — the three together: ``with hold(thread, url, name, ttl=…) as lease:``.

Why each case, as Celery taught it: the handler is installed at the first guarded body of
a process and stays (a late signal must never meet ``SIG_DFL``, which ends the process;
billiard resets ``SIGUSR2`` after ``worker_process_init``), and it is a no-op unless a
guard is inside its body. Never ``SIGUSR1``: Celery's soft time limit owns it. A signal
that arrives while the thread runs C code outside a blocking call is seen by Python only
after that call returns, so until the handler has raised, the signal is sent again every
:data:`RESEND` seconds. A guard's exit and the interrupt are serialised by the guard's
lock: once :meth:`BodyGuard.leave` has run, nothing is sent to the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

import anyio

from ._core.backend import Backend
from ._core.connect import connect
from ._core.context import use_lease
from ._core.exceptions import LeaseLost
from ._core.lease import Lease

__all__ = (
    "INTERRUPT_SIGNAL",
    "RESEND",
    "AsyncLeaseLost",
    "BodyGuard",
    "Handover",
    "LoopThread",
    "ensure_handler",
    "hold",
    "lost_error",
    "run_body",
    "stop_on_loss",
)

logger = logging.getLogger("asynclock")
T = TypeVar("T")

#: Seconds :meth:`LoopThread.close` waits for its backends to close (releasing what they
#: hold) and for its thread to end.
CLOSE_TIMEOUT = 10.0
INTERRUPT_SIGNAL = signal.SIGUSR2
#: Seconds between signals until the handler has raised ``LeaseLost`` in the body.
RESEND = 0.025


class LoopThread:
    """An asyncio event loop on a background thread, and the backends open in it.

    Thread-safe. ``name`` names the thread. Use it as a context manager, or call
    :meth:`close` (idempotent) when done.
    """

    def __init__(self, name: str = "asynclock") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._backends: dict[object, Backend] = {}
        #: Per key: (the task holding its backend open, the event that ends it).
        self._holders: dict[object, tuple[concurrent.futures.Future[None], asyncio.Event]] = {}
        self._keepers: set[asyncio.Task[Any]] = set()  # the tasks holding backends open
        self._lock = threading.Lock()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def call(self, func: Callable[..., T], *args: Any) -> T:
        """Run a plain function on the loop thread and return its result."""

        async def run() -> T:
            return func(*args)

        return self.run(run())

    def backend(self, target: str | Backend) -> Backend:
        """The open backend for ``target``: a URL (connected at its first use) or a
        :class:`~asynclock.Backend` not open yet (entered at its first use, owned by this
        thread from then on). One per target; opened again if it ended (its background
        task failed)."""
        key = target if isinstance(target, str) else id(target)
        backend = self._backends.get(key)
        if backend is not None and not self._holders[key][0].done():
            return backend
        with self._lock:
            backend = self._backends.get(key)
            if backend is None or self._holders[key][0].done():
                backend, self._holders[key] = self._open(target)
                self._backends[key] = backend
        return backend

    def _open(
        self, target: str | Backend
    ) -> tuple[Backend, tuple[concurrent.futures.Future[None], asyncio.Event]]:
        opened: concurrent.futures.Future[tuple[Backend, asyncio.Event]]
        opened = concurrent.futures.Future()

        async def keep_open() -> None:
            # One task enters and leaves the backend (its task group must be left in the
            # task that entered it) and keeps it open until the thread closes.
            stop = asyncio.Event()
            task = asyncio.current_task()
            assert task is not None
            self._keepers.add(task)
            try:
                async with connect(target) if isinstance(target, str) else target as backend:
                    opened.set_result((backend, stop))
                    await stop.wait()
            except BaseException as exc:
                if not opened.done():
                    opened.set_exception(exc)
                raise
            finally:
                self._keepers.discard(task)

        holder = self.submit(keep_open())
        backend, stop = opened.result()
        return backend, (holder, stop)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel the tasks still running on the loop (and wait for them, bounded), close
        every backend (releasing what it holds), then end the thread. Idempotent."""
        with self._lock:
            holders, self._holders = list(self._holders.values()), {}
            self._backends.clear()
        if self.loop.is_closed() or not self._thread.is_alive():
            return
        try:
            self.submit(self._cancel_tasks(timeout)).result(timeout + 1)
        except Exception:
            logger.exception("cancelling the tasks left on the asynclock loop failed")
        for _, stop in holders:
            self.loop.call_soon_threadsafe(stop.set)
        for holder, _ in holders:
            try:
                holder.result(timeout=timeout)
            except Exception:
                logger.exception("closing an asynclock backend failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    async def _cancel_tasks(self, timeout: float) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me and t not in self._keepers]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


# -- stopping a body ------------------------------------------------------------------------

#: Guards inside their body, per thread id, innermost last.
_active: dict[int, list[BodyGuard]] = {}


class AsyncLeaseLost(LeaseLost):
    """Raised in a non-main thread by ``PyThreadState_SetAsyncExc``, which can only raise
    a class without arguments: it fills in the innermost fired guard's lease."""

    def __init__(self, *args: object) -> None:
        if len(args) == 3:
            super().__init__(*args)  # type: ignore[arg-type]  # unpickling
            return
        guards = _active.get(threading.get_ident(), [])
        lease = next((g.lease for g in reversed(guards) if g.fired), None)
        if lease is None:
            super().__init__("?", 0, "lost")
        else:
            super().__init__(lease.name, lease.token, lease.lost.reason or "lost")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    for guard in reversed(_active.get(threading.get_ident(), [])):
        if guard.in_body and guard.fired and not guard.delivered:
            guard.delivered = True
            lease = guard.lease
            raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost")


def ensure_handler() -> None:
    """Install the ``SIGUSR2`` handler (main thread only; cheap when already installed)."""
    if signal.getsignal(INTERRUPT_SIGNAL) is not _on_signal:
        signal.signal(INTERRUPT_SIGNAL, _on_signal)


class BodyGuard:
    """Stops one body when ``lease`` is lost: a signal (main thread), an async exception
    (other threads), or ``cancel()`` when given (a body that is a coroutine elsewhere).

    Made in the body's thread; :meth:`enter` as the body starts, :meth:`leave` as it ends,
    :meth:`interrupt` from the loop thread when the lease is lost.
    """

    __slots__ = (
        "_cancel",
        "_lock",
        "_use_signal",
        "active",
        "delivered",
        "fired",
        "in_body",
        "lease",
        "thread_id",
    )

    def __init__(self, lease: Lease, cancel: Callable[[], None] | None = None) -> None:
        self.lease = lease
        self.thread_id = threading.get_ident()
        self._use_signal = cancel is None and threading.current_thread() is threading.main_thread()
        if self._use_signal:
            ensure_handler()
        self._cancel = cancel
        self._lock = threading.Lock()
        self.active = False
        self.in_body = False
        self.fired = False
        self.delivered = False

    def enter(self) -> None:
        """The body starts now; raises LeaseLost at once if the lease is already lost."""
        with self._lock:
            self.active = self.in_body = True
            _active.setdefault(self.thread_id, []).append(self)
        self.lease.check()

    def interrupt(self) -> None:
        """Called on the event-loop thread when the lease is lost."""
        with self._lock:
            if not self.active:
                return  # not in the body (yet or any more): enter() and leave() check
            self.fired = True
            if self._cancel is not None:
                self._cancel()
            elif self._use_signal:
                signal.pthread_kill(self.thread_id, INTERRUPT_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(AsyncLeaseLost)
                )

    def undelivered(self) -> bool:
        """True while a signal was sent and its handler has not raised in the body yet."""
        return self._use_signal and self.active and self.fired and not self.delivered

    def leave(self) -> None:
        """The body is over: nothing may interrupt this thread after this returns."""
        self.in_body = False
        while True:
            try:
                with self._lock:
                    if self.active:
                        self.active = False
                        guards = _active.get(self.thread_id, [])
                        if self in guards:
                            guards.remove(self)
                        if not guards:
                            _active.pop(self.thread_id, None)
                    if self.fired and not self._use_signal and self._cancel is None:
                        # Withdraw an async exception not raised yet.
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(self.thread_id), None
                        )
                return
            except AsyncLeaseLost:
                self.delivered = True  # raised during our own exit: already handled


async def stop_on_loss(lease: Lease, guard: BodyGuard) -> None:
    """On the loop thread: wait until ``lease`` is lost, then stop ``guard``'s body (a
    signal is sent again every :data:`RESEND` seconds until its handler has raised)."""
    await lease.lost.wait()
    guard.interrupt()
    while guard.undelivered():
        await anyio.sleep(RESEND)
        guard.interrupt()


def lost_error(lease: Lease) -> LeaseLost | None:
    """A fresh ``LeaseLost`` if ``lease`` is lost (or past its deadline) now, else None."""
    try:
        lease.check()
    except LeaseLost as lost:
        return LeaseLost(lost.name, lost.token, lost.reason)
    return None


# -- one lease for one body ----------------------------------------------------------------


class Handover:
    """One body's lease: taken, watched and given back by one task on the loop thread.

    The body's thread and the loop hand over with one lock, each step one wake-up: the
    body's thread posts :meth:`begin` (acquire) and waits; the loop signals the grant (or
    the error) and watches the lease, interrupting :attr:`guard` when it is lost; the body's
    thread posts :meth:`end` when the body is over and waits; the loop releases
    (owner-checked) and signals. (It replaced a submitted coroutine and a future per step
    plus a watcher task, and cut the CPU a lock adds to a Celery run by about a fifth.)
    """

    __slots__ = ("_finished", "_loop", "_ready", "_scope", "_task", "error", "guard", "lease")

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
        """Post the acquisition and wait for its outcome (:attr:`lease` or :attr:`error`)."""
        self._loop.call_soon_threadsafe(self._start, backend, name, (ttl, blocking, timeout))
        try:
            self._ready.acquire()
        except BaseException:
            # Interrupted while waiting (a time limit, a shutdown): stop waiting for the
            # lock; if it is granted after all, give it back instead of renewing it for the
            # process's life.
            self._loop.call_soon_threadsafe(self._finish)
            raise

    def end(self) -> None:
        """The body is over: post the release and wait until it is done."""
        self._loop.call_soon_threadsafe(self._finish)
        self._ready.acquire()

    # -- the loop's side

    def _start(self, backend: Backend, name: str, args: tuple[float, bool, float | None]) -> None:
        self._task = self._loop.create_task(self._run(backend, name, *args))

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


def run_body(
    body: Callable[[], T], lease: Lease, handover: Handover
) -> tuple[T | None, BaseException | None]:
    """Run ``body`` in this thread under ``lease`` (its :func:`asynclock.current_lease`),
    stopped with ``LeaseLost`` when the lease is lost. Returns ``(result, error)``: a body
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
