"""One event-loop thread and one asynclock backend per worker process (opened lazily).

A prefork child gets its runtime at its first locked task, after the fork: a runtime
inherited from a parent (its loop thread does not exist in the child) is dropped, never
used. The runtime closes at ``worker_process_shutdown`` (prefork children) and
``worker_shutdown`` (solo, threads), releasing whatever it still holds.

The loop is a plain asyncio loop on a thread of its own, reached with
``asyncio.run_coroutine_threadsafe``: one hop per call (anyio's blocking portal costs
two or three per task start, measured as a third of a no-op task's throughput). This
module is the bridge between the worker's threads and that loop; the backend inside it
keeps its own structured concurrency.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from celery import Celery, signals

import asynclock

logger = logging.getLogger("asynclock.celery")
T = TypeVar("T")

#: The Celery setting naming the lock server.
URL_SETTING = "asynclock_url"
#: Seconds to wait for the backends to close (releasing what they hold) at shutdown.
CLOSE_TIMEOUT = 10.0


class Runtime:
    """An event loop on a background thread and the backends open in it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="asynclock-celery", daemon=True)
        self._thread.start()
        self._backends: dict[str, asynclock.Backend] = {}
        #: Per URL: (the task holding its backend open, the event that ends it).
        self._holders: dict[str, tuple[concurrent.futures.Future[None], asyncio.Event]] = {}
        self._lock = threading.Lock()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, func: Callable[..., T], *args: Any) -> T:
        """Run a plain function on the loop thread and return its result."""

        async def run() -> T:
            return func(*args)

        return self.submit(run()).result()

    def backend(self, url: str) -> asynclock.Backend:
        backend = self._backends.get(url)
        if backend is not None and not self._holders[url][0].done():
            return backend
        with self._lock:
            backend = self._backends.get(url)
            if backend is None or self._holders[url][0].done():
                # First use, or the backend ended (its background task failed): open anew.
                backend, self._holders[url] = self._open(url)
                self._backends[url] = backend
        return backend

    def _open(
        self, url: str
    ) -> tuple[asynclock.Backend, tuple[concurrent.futures.Future[None], asyncio.Event]]:
        opened: concurrent.futures.Future[tuple[asynclock.Backend, asyncio.Event]]
        opened = concurrent.futures.Future()

        async def hold() -> None:
            # One task enters and leaves the backend (its task group must be left in the
            # task that entered it) and keeps it open until the runtime closes.
            stop = asyncio.Event()
            try:
                async with asynclock.connect(url) as backend:
                    opened.set_result((backend, stop))
                    await stop.wait()
            except BaseException as exc:
                if not opened.done():
                    opened.set_exception(exc)
                raise

        holder = self.submit(hold())
        backend, stop = opened.result()
        return backend, (holder, stop)

    def close(self) -> None:
        with self._lock:
            holders, self._holders = list(self._holders.values()), {}
            self._backends.clear()
        for _, stop in holders:
            self.loop.call_soon_threadsafe(stop.set)
        for holder, _ in holders:
            try:
                holder.result(timeout=CLOSE_TIMEOUT)
            except Exception:
                logger.exception("closing an asynclock backend failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT)
        if not self._thread.is_alive():
            self.loop.close()


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_runtime() -> Runtime:
    global _runtime
    runtime = _runtime
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()  # a parent's runtime is dropped: its thread is not here
        return _runtime


def close_runtime(**_: Any) -> None:
    """Close this process's backend and event-loop thread (idempotent).

    Connected to Celery's ``worker_process_shutdown`` and ``worker_shutdown`` signals;
    call it yourself if you run locked tasks outside a worker and want to close early.
    """
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
    if runtime is not None and runtime.pid == os.getpid():
        try:
            runtime.close()
        except Exception:
            logger.exception("closing the asynclock backend failed")


signals.worker_process_shutdown.connect(close_runtime, weak=False)
signals.worker_shutdown.connect(close_runtime, weak=False)
atexit.register(close_runtime)


def backend_url(app: Celery) -> str:
    """``asynclock_url``, else the broker's URL when the broker is Redis."""
    url = app.conf.get(URL_SETTING)
    if url:
        return str(url)
    broker = app.conf.broker_url
    if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
        return broker
    raise RuntimeError(
        f"asynclock_celery: set the Celery setting {URL_SETTING!r} to the lock server's URL "
        "(e.g. app.conf.asynclock_url = 'redis://localhost:6379/1' or 'sqlite:///locks.db'); "
        f"the broker ({str(broker).split('://', 1)[0] or 'none'}) is not Redis, so it cannot "
        "be used instead"
    )
