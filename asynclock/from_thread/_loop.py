"""The loop thread: an asyncio event loop on a thread of its own, with its backends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._core.backend import Backend
from .._core.connect import connect

logger = logging.getLogger("asynclock")
T = TypeVar("T")

#: Seconds :meth:`LoopThread.close` waits for its backends to close (releasing what they
#: hold) and for its thread to end.
CLOSE_TIMEOUT = 10.0


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
        #: Per key: (the keep_open() run keeping its backend open, the event that ends it).
        self._keeping: dict[object, tuple[concurrent.futures.Future[None], asyncio.Event]] = {}
        self._keepers: set[asyncio.Task[Any]] = set()  # the tasks keeping backends open
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
        if backend is not None and not self._keeping[key][0].done():
            return backend
        with self._lock:
            backend = self._backends.get(key)
            if backend is None or self._keeping[key][0].done():
                backend, self._keeping[key] = self._open(target)
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

        run = self.submit(keep_open())
        backend, stop = opened.result()
        return backend, (run, stop)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel the tasks still running on the loop (and wait for them, bounded), close
        every backend (releasing what it holds), then end the thread. Idempotent."""
        with self._lock:
            keeping, self._keeping = list(self._keeping.values()), {}
            self._backends.clear()
        if self.loop.is_closed() or not self._thread.is_alive():
            return
        try:
            self.submit(self._cancel_tasks(timeout)).result(timeout + 1)
        except Exception:
            logger.exception("cancelling the tasks left on the asynclock loop failed")
        for _, stop in keeping:
            self.loop.call_soon_threadsafe(stop.set)
        for run, _ in keeping:
            try:
                run.result(timeout=timeout)
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
