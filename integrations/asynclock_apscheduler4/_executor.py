"""``ClaimingJobExecutor``: a claim per job occurrence around an APScheduler 4 job executor.

The seam is ``JobExecutor.run_job(func, job)``: APScheduler 4 calls it on the scheduler's
own event loop, after the data store handed the job to this scheduler and right before
the job runs, with the job's schedule id and scheduled fire time. So the claim is an
ordinary ``async with backend.lock(...)`` on that loop (no thread of our own), and the
backend is opened in ``start(exit_stack)``, which APScheduler unwinds at shutdown.

Per job: claim ``"{schedule id}@{fire time without jitter, UTC ISO}"`` (``"{task id}@{job
id}"`` for a job added without a schedule), token scope = the schedule id (or task id),
non-blocking. Busy means another scheduler runs this occurrence (the data store lets a
job whose lease lapsed be acquired again): the job ends with ``LockHeld`` and its body
never starts. Held: the body runs inside the lock (``asynclock.current_lease()`` is the
claim), so a lost claim cancels an async job or interrupts a thread-pool job
(``asynclock.from_thread.guard``: an async exception in its thread), and the job ends
with ``LeaseLost``. After a run the claim is kept one more ttl (``let_expire``), not
released.

The arithmetic: a frozen scheduler's data-store lease on a job lapses no sooner than half
the scheduler's ``lease_duration`` after the freeze (it is extended every half), and its
claim expires at most ``claim_ttl`` after it. With ``claim_ttl + clock_skew <
lease_duration / 2`` (checked when the scheduler starts the executor) the scheduler that
acquires the lapsed job finds the claim gone and runs the job, with a larger token that
fences off the frozen run; otherwise it would find the claim busy and the job would end
with ``LockHeld``, run by nobody.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from contextlib import AsyncExitStack
from datetime import UTC
from typing import Any

from apscheduler import Job, current_async_scheduler
from apscheduler.abc import JobExecutor
from apscheduler.executors.async_ import AsyncJobExecutor
from apscheduler.executors.subprocess import ProcessPoolJobExecutor
from apscheduler.executors.thread import ThreadPoolJobExecutor

import asynclock
from asynclock import from_thread


def occurrence_name(job: Job) -> str:
    """The claim's lock name for ``job`` (see the module doc)."""
    fire_time = job.original_scheduled_time
    if job.schedule_id is not None and fire_time is not None:
        return f"{job.schedule_id}@{fire_time.astimezone(UTC).isoformat()}"
    return f"{job.task_id}@{job.id}"


def _scope(job: Job) -> str:
    return str(job.schedule_id if job.schedule_id is not None else job.task_id)


class ClaimingJobExecutor(JobExecutor):  # type: ignore[misc]
    """Wraps an APScheduler 4 job executor with a claim per job (see the module doc).

    ``AsyncScheduler(data_store, job_executors={"async": ClaimingJobExecutor(url,
    claim_ttl=30)})``, the same on every scheduler sharing the data store.

    Args:
        url_or_backend: a lock URL, or an ``asynclock.Backend`` that is not open yet
            (opened when the scheduler starts its executors, closed at its shutdown).
        claim_ttl: seconds; a lost claim (a frozen or cut-off scheduler) stops its job
            within about this long.
        inner: the executor that runs the job: ``AsyncJobExecutor`` (default) or
            ``ThreadPoolJobExecutor``; a process pool is refused (its run could not be
            stopped from here).
        clock_skew: seconds the schedulers' clocks may differ by (default 1); with
            ``claim_ttl`` it must stay under half the scheduler's ``lease_duration``.
    """

    def __init__(
        self,
        url_or_backend: str | asynclock.Backend,
        *,
        claim_ttl: float,
        inner: JobExecutor | None = None,
        clock_skew: float = 1.0,
    ) -> None:
        if isinstance(url_or_backend, str):
            if "://" not in url_or_backend:
                raise ValueError(
                    "url_or_backend must be a lock URL like 'redis://host:6379/0' or "
                    f"'sqlite:///locks.db', got {url_or_backend!r}"
                )
        elif not isinstance(url_or_backend, asynclock.Backend):
            raise TypeError(
                "url_or_backend must be a lock URL (str) or an asynclock.Backend that is "
                f"not open yet, not {type(url_or_backend).__name__}"
            )
        claim_ttl = asynclock.check_seconds(claim_ttl, "claim_ttl", lease=True)
        clock_skew = asynclock.check_seconds(clock_skew, "clock_skew", zero=True)
        if inner is None:
            inner = AsyncJobExecutor()
        if isinstance(inner, ClaimingJobExecutor):
            raise TypeError("inner must not be another ClaimingJobExecutor")
        if isinstance(inner, ProcessPoolJobExecutor):
            raise TypeError(
                "inner must run jobs in this process (AsyncJobExecutor or "
                "ThreadPoolJobExecutor): the claim is held here, and a process pool's run "
                "could not be stopped"
            )
        if not isinstance(inner, (AsyncJobExecutor, ThreadPoolJobExecutor)):
            raise TypeError(
                "inner must be an AsyncJobExecutor or a ThreadPoolJobExecutor, not "
                f"{type(inner).__name__}"
            )
        self._target = url_or_backend
        self.claim_ttl = float(claim_ttl)
        self.clock_skew = float(clock_skew)
        self._inner = inner
        self._backend: asynclock.Backend | None = None

    @property
    def backend(self) -> asynclock.Backend:
        """The open backend (on the scheduler's event loop)."""
        if self._backend is None:
            raise RuntimeError("not started: the scheduler starts its job executors")
        return self._backend

    async def start(self, exit_stack: AsyncExitStack) -> None:
        scheduler = current_async_scheduler.get()
        if scheduler is not None:
            half = scheduler.lease_duration.total_seconds() / 2
            if self.claim_ttl + self.clock_skew >= half:
                raise ValueError(
                    f"claim_ttl ({self.claim_ttl:g}s) + clock_skew ({self.clock_skew:g}s) "
                    f"must be under half the scheduler's lease_duration ({half:g}s): a "
                    "scheduler that acquires a frozen scheduler's lapsed job must find its "
                    "claim expired, or the job ends with LockHeld and nobody runs it. "
                    "Lower claim_ttl or raise AsyncScheduler(lease_duration=...)"
                )
        await self._inner.start(exit_stack)
        target = self._target
        backend = target if isinstance(target, asynclock.Backend) else asynclock.connect(target)
        self._backend = await exit_stack.enter_async_context(backend)
        exit_stack.callback(setattr, self, "_backend", None)

    async def run_job(self, func: Callable[..., Any], job: Job) -> Any:
        backend = self.backend
        async with backend.lock(
            occurrence_name(job),
            ttl=self.claim_ttl,
            blocking=False,
            token_scope=_scope(job),
        ) as lease:
            with asynclock.use_lease(lease):
                if isinstance(self._inner, ThreadPoolJobExecutor):
                    # The lock's cancel scope cannot stop a thread: the body is stopped in
                    # its thread (from_thread.guard, watching from this loop).
                    func = _guarded(func, lease, asyncio.get_running_loop())
                result = await self._inner.run_job(func, job)
            lease.check()  # a run that returned after its deadline is not a success
            await lease.let_expire()  # keep it one more ttl: no second run
        return result


def _guarded(
    func: Callable[..., Any], lease: asynclock.Lease, loop: asyncio.AbstractEventLoop
) -> Callable[..., Any]:
    """``func`` run in a pool thread under ``lease`` (held on ``loop``), stopped on loss."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        with from_thread.guard(lease, loop):
            return func(*args, **kwargs)

    return run
