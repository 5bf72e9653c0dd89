"""``lock_limit``: a run holds one of ``limit`` permits of a semaphore instead of a lock.

The permit is taken and held by one task on the worker process's event-loop thread
(``async with backend.semaphore(name, limit).acquire(...)``), which renews it with the
backend's other leases; the body runs in the worker's thread under
``from_thread.guard(permit.lease, loop)``, so a lost permit stops it as a lost lock does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import asynclock
from asynclock import from_thread

from ._busy import annotate, held
from ._policy import Policy
from ._runtime import get_runtime, run_body

logger = logging.getLogger("asynclock.celery")

#: The largest ``lock_limit`` (the core's cap on a semaphore's limit).
MAX_LIMIT = 10_000


def check_limit(limit: object, what: str = "lock_limit") -> int | None:
    """``None`` (a lock), or a semaphore's limit: an int from 1 to 10 000, not a bool."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"{what} must be None or an int from 1 to {MAX_LIMIT}, got {limit!r}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"{what} must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    return limit


@contextlib.contextmanager
def hold_permit(
    thread: from_thread.LoopThread,
    url: str,
    name: str,
    limit: int,
    *,
    ttl: float,
    blocking: bool,
    timeout: float | None,
) -> Iterator[asynclock.Permit]:
    """``with hold_permit(...) as permit:`` one permit of ``name``, held (and renewed) by a
    task on ``thread`` until the block ends; raises what ``acquire`` raises (``LockHeld``,
    ``AcquireTimeout``, ``BackendUnavailable`` …). The body is not guarded here: the caller
    runs it under ``from_thread.guard(permit.lease, thread.loop)``."""
    backend = thread.backend(url)
    granted: concurrent.futures.Future[tuple[asynclock.Permit, asyncio.Event]]
    granted = concurrent.futures.Future()

    async def keep() -> None:
        end = asyncio.Event()
        try:
            sem = backend.semaphore(name, limit)
            async with sem.acquire(ttl=ttl, timeout=timeout, blocking=blocking) as permit:
                granted.set_result((permit, end))
                await end.wait()
        except BaseException as exc:
            if not granted.done():
                granted.set_exception(exc)
            raise

    task = thread.submit(keep())
    try:
        permit, end = granted.result()
    except BaseException:
        task.cancel()  # a soft time limit while waiting: a permit got meanwhile is released
        raise
    try:
        yield permit
    finally:
        thread.loop.call_soon_threadsafe(end.set)
        try:
            task.result(timeout=2 * ttl)  # released: the server has answered
        except asynclock.LeaseLost:
            pass  # the guard around the body has raised it already
        except Exception as exc:  # the permit expires by its ttl
            logger.warning(
                "release of a permit of %r failed (it expires by its ttl): %r", name, exc
            )


def run_limited(
    task: Any,
    body: Callable[[], Any],
    *,
    name: str,
    limit: int,
    policy: Policy,
    is_async: bool,
    template: asynclock.NameTemplate | None = None,
) -> Any:
    """Run ``body`` holding one of ``limit`` permits of the semaphore ``name``
    (``lock_limit``); busy means all ``limit`` are held, and goes through ``on_busy``."""
    runtime = get_runtime()
    wait = policy.on_busy == "wait"
    ttl, timeout = policy.ttl, policy.timeout

    def run(permit: asynclock.Permit) -> Any:
        annotate(task, permit.lease, template)
        if task is not None:
            task.request.asynclock_permit = permit
        if is_async:
            return run_body(body, permit.lease, runtime.loop, is_async)
        with from_thread.guard(permit.lease, runtime.loop):
            return body()

    return held(
        task,
        name,
        policy,
        lambda url: hold_permit(runtime, url, name, limit, ttl=ttl, blocking=wait, timeout=timeout),
        run,
    )
