"""The wrapped job functions: a run under its occurrence's claim, stopped when it is lost."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

from asynclock import from_thread

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


def _permit_guard(occurrence: Occurrence, thread: from_thread.LoopThread) -> Any:
    """The run's instance permit (``fleet_max_instances``) stops it when lost, as its
    claim does; nothing without one."""
    if occurrence.permit is None:
        return contextlib.nullcontext()
    return from_thread.guard(occurrence.permit.lease, thread.loop)


def sync_runner(
    thread: from_thread.LoopThread,
    func: Callable[..., Any],
    occurrence: Occurrence,
    finish: Callable[[], concurrent.futures.Future[Any] | None],
    tracer: Any | None = None,
) -> Callable[..., Any]:
    """``func`` for a thread-pool run under the occurrence's claim (stopped on loss)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        lease = occurrence.lease
        token = _OCCURRENCE.set(occurrence)
        try:
            with (
                _run_span(tracer, occurrence),
                _permit_guard(occurrence, thread),
                from_thread.guard(lease, thread.loop),  # inner: current_lease() is the claim
            ):
                return func(*args, **kwargs)
        finally:
            _OCCURRENCE.reset(token)
            finishing = finish()
            if finishing is not None:
                concurrent.futures.wait([finishing], timeout=2 * lease.ttl)

    return run


def async_runner(
    thread: from_thread.LoopThread,
    func: Callable[..., Any],
    occurrence: Occurrence,
    finish: Callable[[], concurrent.futures.Future[Any] | None],
    tracer: Any | None = None,
) -> Callable[..., Any]:
    """``func`` for an AsyncIOExecutor run under the occurrence's claim (cancelled on loss)."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        lease = occurrence.lease
        token = _OCCURRENCE.set(occurrence)
        try:
            with _run_span(tracer, occurrence):
                async with (
                    _permit_guard(occurrence, thread),
                    from_thread.guard(lease, thread.loop),
                ):
                    return await func(*args, **kwargs)
        finally:
            _OCCURRENCE.reset(token)
            finishing = finish()
            if finishing is not None:
                # Bounded by the backend's release timeout; if it never answers, the
                # claim still expires within its ttl from the last renewal.
                await asyncio.wait([asyncio.wrap_future(finishing)], timeout=2 * lease.ttl)

    return run
