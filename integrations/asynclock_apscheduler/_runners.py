"""The wrapped job functions: a run under its occurrence's claim, stopped when it is lost."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

import asynclock
import asynclock.from_thread

from ._jobs import _OCCURRENCE, Occurrence

try:  # the otel extra: one span per run, carrying the claim's token
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - depends on the environment
    _trace = None  # type: ignore[assignment]


def run_tracer(tracer_provider: Any | None) -> Any | None:
    """The tracer of the runs' spans (``tracer_provider``, else the global one), or None
    without OpenTelemetry."""
    if _trace is None:
        return None
    return _trace.get_tracer("asynclock_apscheduler", tracer_provider=tracer_provider)


def _run_span(tracer: Any | None, occurrence: Occurrence) -> contextlib.AbstractContextManager[Any]:
    """``run {job id}``, INTERNAL, current while the job runs: its token and run time."""
    if tracer is None:
        return contextlib.nullcontext()
    span: contextlib.AbstractContextManager[Any] = tracer.start_as_current_span(
        f"run {occurrence.job_id}",
        kind=_trace.SpanKind.INTERNAL,
        attributes={
            "asynclock.lease.token": occurrence.token,
            "asynclock.lock.name_template": "{job_id}@{run_time}",
            "apscheduler.job.id": occurrence.job_id,
            "apscheduler.run_time": occurrence.run_time.isoformat(),
        },
    )
    return span


def sync_runner(
    thread: asynclock.from_thread.LoopThread,
    func: Callable[..., Any],
    occurrence: Occurrence,
    finish: Callable[[], concurrent.futures.Future[Any] | None],
    tracer: Any | None = None,
) -> Callable[..., Any]:
    """``func`` for a thread-pool run under the occurrence's claim (stopped on loss)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        lease = occurrence.lease
        guard = asynclock.from_thread.BodyGuard(lease)  # stops this thread's body on loss
        watch = thread.submit(asynclock.from_thread.stop_on_loss(lease, guard))
        token = _OCCURRENCE.set(occurrence)
        try:
            with _run_span(tracer, occurrence), asynclock.use_lease(lease):
                try:
                    try:
                        guard.enter()
                        result = func(*args, **kwargs)
                    finally:
                        guard.leave()
                except asynclock.LeaseLost:
                    if not lease.lost and not guard.fired:
                        raise  # the body's own
                    raise _lost(lease) from None
                if lease.lost:  # the body swallowed the interruption
                    raise _lost(lease)
                # A thawed run can return before the loss reached it: ask the clock.
                lease.check()
            return result
        finally:
            _OCCURRENCE.reset(token)
            watch.cancel()
            finishing = finish()
            if finishing is not None:
                concurrent.futures.wait([finishing], timeout=2 * lease.ttl)

    return run


def async_runner(
    thread: asynclock.from_thread.LoopThread,
    func: Callable[..., Any],
    occurrence: Occurrence,
    finish: Callable[[], concurrent.futures.Future[Any] | None],
    tracer: Any | None = None,
) -> Callable[..., Any]:
    """``func`` for an AsyncIOExecutor run under the occurrence's claim (cancelled on loss)."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        lease = occurrence.lease
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        running = [True]

        def stop() -> None:  # on the job's loop: cancel the body only
            if running[0]:
                task.cancel()

        watch = thread.submit(_on_loss(lease, lambda: loop.call_soon_threadsafe(stop)))
        token = _OCCURRENCE.set(occurrence)
        try:
            with _run_span(tracer, occurrence), asynclock.use_lease(lease):
                try:
                    result = await func(*args, **kwargs)
                except asyncio.CancelledError:
                    if not lease.lost:
                        raise
                    task.uncancel()
                    raise _lost(lease) from None
                finally:
                    running[0] = False
                if lease.lost:
                    raise _lost(lease)
                lease.check()  # as in the sync runner
            return result
        finally:
            _OCCURRENCE.reset(token)
            watch.cancel()
            finishing = finish()
            if finishing is not None:
                # Bounded by the backend's release timeout; if it never answers, the
                # claim still expires within its ttl from the last renewal.
                await asyncio.wait([asyncio.wrap_future(finishing)], timeout=2 * lease.ttl)

    return run


def _lost(lease: asynclock.Lease) -> asynclock.LeaseLost:
    return asynclock.LeaseLost(lease.name, lease.token, lease.lost.reason or "claim lost")


async def _on_loss(lease: asynclock.Lease, stop: Callable[[], object]) -> None:
    await lease.lost
    stop()
