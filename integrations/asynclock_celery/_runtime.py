"""One event-loop thread and one asynclock backend per worker process (opened lazily), and
one ``asyncio.Runner`` per process and thread for the async task bodies.

A prefork child gets its runtime at its first locked task, after the fork: a runtime
inherited from a parent (its loop thread does not exist in the child) is dropped, never
used. The runtime closes at ``worker_process_shutdown`` (prefork children) and
``worker_shutdown`` (solo, threads), releasing whatever it still holds.

The loop thread is asynclock's one thread bridge, :class:`asynclock.from_thread.LoopThread`;
this module only ties its life to the worker's.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, cast

from celery import Celery, signals

import asynclock
from asynclock.from_thread import LoopThread, guard

logger = logging.getLogger("asynclock.celery")

#: The Celery setting naming the lock server.
URL_SETTING = "asynclock_url"


class Runtime(LoopThread):
    """This worker process's event-loop thread (:class:`asynclock.from_thread.LoopThread`)
    and the backends open on it, remembering the process that made it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        super().__init__(name="asynclock-celery")


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


# -- async bodies: one asyncio.Runner per process and thread ------------------------------

_runners: dict[tuple[int, int], asyncio.Runner] = {}


def _runner() -> asyncio.Runner:
    """This thread's runner: module-level async clients keep working across tasks (a loop
    per task would break them). Made lazily, so a prefork child makes its own."""
    key = (os.getpid(), threading.get_ident())
    runner = _runners.get(key)
    if runner is None:
        for stale in [k for k in _runners if k[0] != key[0]]:
            del _runners[stale]  # inherited over fork: never used, never closed here
        runner = _runners[key] = asyncio.Runner()
    return runner


def run_body(
    body: Callable[[], Any], lease: asynclock.Lease, loop: asyncio.AbstractEventLoop, is_async: bool
) -> Any:
    """``body()`` in this thread, inside the run's hold (which stops it on loss); a
    coroutine body on this thread's runner, cancelled on loss (``from_thread.guard``)."""
    if not is_async:
        return body()
    return guard(lease, loop).run(_runner(), cast(Callable[[], Coroutine[Any, Any, Any]], body))
