"""Stopping a body when its lease is lost: the one interrupter (see the package doc).

Each way a lease's loss reaches its body ends in :meth:`BodyGuard.stop`, on the loop that
holds the lease: a task awaiting ``lease.lost`` (a lease the loop granted) or the loss
callback of a lease the body's thread was granted itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import threading
from collections.abc import Callable
from types import FrameType

from .._core.exceptions import LeaseLost
from .._core.lease import Lease

INTERRUPT_SIGNAL = signal.SIGUSR2
#: Seconds between signals until the handler has raised ``LeaseLost`` in the body.
RESEND = 0.025

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
    if asyncio._get_running_loop() is not None:
        # An event loop runs in this thread, with no guarded coroutine to cancel (one
        # would have been, see BodyGuard.interrupt): raised here, LeaseLost would end the
        # loop's machinery mid-step and leave its tasks behind. The signal is sent again
        # (RESEND) until the loop has returned, or a guarded coroutine's entry sees the loss.
        return
    for guard in reversed(_active.get(threading.get_ident(), [])):
        if guard.in_body and guard.fired and not guard.delivered:
            guard.delivered = True
            lease = guard.lease
            raise LeaseLost(lease.name, lease.token, lease.lost.reason or "lost")


# signal.getsignal turns every answer into a Handlers enum, which for a function costs a
# raised and caught ValueError (2 us, on every guarded run); the C function answers as is.
def _raw_getsignal() -> Callable[[int], object]:
    try:
        import _signal  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # not CPython
        return signal.getsignal
    getsignal: Callable[[int], object] = _signal.getsignal
    return getsignal


_getsignal = _raw_getsignal()


def ensure_handler() -> None:
    """Install the ``SIGUSR2`` handler (main thread only; cheap when already installed)."""
    if _getsignal(INTERRUPT_SIGNAL) is not _on_signal:
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

    def __init__(self, lease: Lease, cancel: Callable[[], object] | None = None) -> None:
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
                return
            inner = self._inner_coroutine()
            if inner is not None:
                # The thread runs a guarded coroutine on an event loop of its own (a Celery
                # async task under its hold): a signal or an async exception would be
                # raised inside that loop's machinery and leave its task behind. Cancel the
                # coroutine instead; the thread's code then reaches this guard's leave(),
                # whose block raises LeaseLost.
                inner.cancel_now()
                self.delivered = True
            elif self._use_signal:
                signal.pthread_kill(self.thread_id, INTERRUPT_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread_id), ctypes.py_object(AsyncLeaseLost)
                )

    def _inner_coroutine(self) -> BodyGuard | None:
        """The innermost guard entered after this one on its thread that cancels a
        coroutine, if any (called with the lock held)."""
        guards = list(_active.get(self.thread_id, ()))
        for other in reversed(guards):
            if other is self:
                return None
            if other._cancel is not None and other.active:
                return other
        return None

    def cancel_now(self) -> None:
        """Cancel this guard's coroutine (from any thread): a no-op once it has left."""
        if self._cancel is not None and self.active:
            self.fired = True
            self._cancel()

    def stop(self) -> None:
        """On the loop thread, once the lease is lost: interrupt the body; a signal its
        handler has not raised yet is sent again every :data:`RESEND` seconds (a thread in
        C code outside a blocking call sees a signal only when that call returns)."""
        self.interrupt()
        if self.undelivered():
            asyncio.get_running_loop().call_later(RESEND, self.stop)

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
    """On the loop thread: wait until ``lease`` is lost, then stop ``guard``'s body
    (:meth:`BodyGuard.stop`)."""
    await lease.lost.wait()
    guard.stop()


def lost_error(lease: Lease) -> LeaseLost | None:
    """A fresh ``LeaseLost`` if ``lease`` is lost (or past its deadline) now, else None."""
    try:
        lease.check()
    except LeaseLost as lost:
        return LeaseLost(lost.name, lost.token, lost.reason)
    return None
