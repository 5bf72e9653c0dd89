"""``ClaimingExecutor``: claim each job occurrence before it runs (APScheduler 3.11).

The seam is the executor's ``submit_job(job, run_times)``: it is the first place that
knows an occurrence's scheduled run time (listeners fire after the run; a wrapped
``job.func`` never learns the run time). Per run time:

1. claim ``"{job.id}@{run time, UTC ISO}"`` (token scope = the job id, so one job's first
   claims rise with its run times on every backend) on the executor's own event-loop
   thread. Busy means another scheduler has this occurrence: wait for the claim in the
   background (a blocking acquire, not the scheduler's thread) until the takeover window
   ends, ``takeover_window`` seconds after the run time. A lock server that does not
   answer is asked again until then; one in its restart grace (it lost its data) is
   waited for only while the occurrence can still start in time. An occurrence that
   cannot be claimed in time is reported missed (``EVENT_JOB_MISSED``). See ``_claiming``;
2. whoever gets the claim first asks for the occurrence's *done marker*
   (``"{claim name}#done"``, a lease nobody renews): there, the occurrence already
   finished elsewhere, so release the claim and skip it;
3. otherwise hand the occurrence to the inner executor (AsyncIO for ``AsyncIOScheduler``,
   a thread pool otherwise) with a wrapped function that holds the claim while it runs:
   ``asynclock.current_lease()`` and :func:`current_occurrence` answer inside, and a lost
   claim cancels an async job or interrupts a sync one (an async exception in its thread);
   the job then ends with ``LeaseLost`` in APScheduler's ``EVENT_JOB_ERROR``;
4. after the run, if the claim is still held, record the done marker (kept long enough
   to outlive every node's takeover window), then release the claim so the waiters see
   the marker at once. A run whose claim was lost (a frozen or killed node) records
   nothing: its claim expires and a waiter takes the occurrence over, with a larger token
   that fences off the stale run's late writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.executors.base import BaseExecutor, MaxInstancesReachedError
from apscheduler.executors.pool import ProcessPoolExecutor, ThreadPoolExecutor

import asynclock

from ._claiming import Missed, Skipped, get_claim, monotonic_deadline, record_done
from ._instances import InstancePermit
from ._jobs import (
    Occurrence,
    check_job,
    done_name,
    occurrence_name,
    start_by,
    takeover_bounds,
)
from ._loop import Bridge, check_target
from ._runners import async_runner, run_tracer, sync_runner

logger = logging.getLogger("asynclock.apscheduler")


class _OccurrenceJob:
    """What the inner executor runs for one claimed occurrence (``run_job`` reads these)."""

    __slots__ = ("_jobstore_alias", "_str", "args", "func", "id", "kwargs", "max_instances")
    misfire_grace_time = None  # checked before the claim; the inner run must not skip it
    coalesce = True

    def __init__(self, job: Any, func: Callable[..., Any]) -> None:
        self.id = job.id
        self.func = func
        self.args = job.args
        self.kwargs = job.kwargs
        self.max_instances = job.max_instances
        self._jobstore_alias = job._jobstore_alias
        self._str = str(job)

    def __str__(self) -> str:
        return self._str


class ClaimingExecutor(BaseExecutor):  # type: ignore[misc]
    """An executor that claims each occurrence before running it (see the module doc).

    ``executors={"default": ClaimingExecutor("redis://…", claim_ttl=60)}`` on every
    scheduler of the fleet, all with the same jobs (ids and triggers).

    Args:
        url_or_backend: a lock URL, or an ``asynclock.Backend`` that is not open yet
            (the executor opens it on its own event-loop thread and closes it at shutdown).
        claim_ttl: seconds; the claim's ttl. Must exceed each job's ``misfire_grace_time``
            plus ``clock_skew`` (checked, see :func:`check_job`); a lost claim (a frozen
            or cut-off scheduler) stops its run within about this long.
        inner: the executor that runs the jobs (default: an ``AsyncIOExecutor`` under
            ``AsyncIOScheduler``, else a ``ThreadPoolExecutor``).
        clock_skew: seconds the schedulers' clocks may differ by (default 1).
        takeover_window: seconds after an occurrence's run time during which a scheduler
            that found its claim busy waits for it, to take the occurrence over if its
            claimant's claim is lost (a frozen or killed node). Default: each job's
            ``misfire_grace_time + clock_skew + 2 * claim_ttl``; it must exceed
            ``misfire_grace_time + clock_skew + claim_ttl`` (checked). A run lost later
            than ``takeover_window - claim_ttl`` after its run time is not taken over:
            raise it for jobs that run long. A lock server that does not answer is
            asked again, with backoff, until it ends; then the occurrence is reported
            missed.
        tracer_provider: OpenTelemetry's (default: the global one; nothing without the
            ``otel`` extra): each run is a span ``run {job id}`` (INTERNAL) with the claim's
            token (``asynclock.lease.token``) and the run time, current while the job runs.
        fleet_max_instances: each job's ``max_instances`` holds across the fleet, not per
            scheduler: a run also holds one of ``max_instances`` permits of the semaphore
            ``backend.semaphore(job.id, job.max_instances)`` (ttl ``claim_ttl``, renewed
            with the claim; :attr:`Occurrence.permit`). A run that finds every permit held
            is skipped as APScheduler skips at ``max_instances`` (same warning,
            ``EVENT_JOB_MAX_INSTANCES``) and marked done, so no node runs it; a takeover
            waits for a permit until its takeover window ends. A killed node's permit is
            free within ``claim_ttl``. Needs a backend with semaphores (memory, SQLite,
            Redis on one server, PostgreSQL).

    During a restart grace of the lock server (it lost its data: a new database, or a
    restart without persistence) an occurrence waits for the grace's end only if it can
    still start within its ``misfire_grace_time`` and before the job's next run time;
    otherwise it is reported missed. The grace must last at least ``claim_ttl`` (Redis:
    ``restart_grace``, by default the first ttl asked for after the server starts).
    """

    def __init__(
        self,
        url_or_backend: str | asynclock.Backend,
        *,
        claim_ttl: float,
        inner: BaseExecutor | None = None,
        clock_skew: float = 1.0,
        takeover_window: float | None = None,
        tracer_provider: Any | None = None,
        fleet_max_instances: bool = False,
    ) -> None:
        super().__init__()
        target = check_target(url_or_backend)
        claim_ttl = asynclock.check_seconds(claim_ttl, "claim_ttl", lease=True)
        clock_skew = asynclock.check_seconds(clock_skew, "clock_skew", zero=True)
        if takeover_window is not None:
            takeover_window = asynclock.check_seconds(takeover_window, "takeover_window")
        if inner is not None and not isinstance(inner, BaseExecutor):
            raise TypeError(f"inner must be an APScheduler executor, not {type(inner).__name__}")
        if isinstance(inner, ClaimingExecutor):
            raise TypeError("inner must not be another ClaimingExecutor")
        if isinstance(inner, ProcessPoolExecutor):
            raise TypeError(
                "inner must run jobs in this process (a thread pool or AsyncIOExecutor): the "
                "claim is held and renewed here, and a process pool could not stop its run"
            )
        if not isinstance(fleet_max_instances, bool):
            raise TypeError(
                f"fleet_max_instances must be True or False, not {fleet_max_instances!r}"
            )
        self.fleet_max_instances = fleet_max_instances
        self.claim_ttl = float(claim_ttl)
        self.clock_skew = float(clock_skew)
        self._tracer = run_tracer(tracer_provider)
        self.takeover_window = takeover_window
        self._inner = inner
        self._loop_thread = Bridge(target)
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        self._claims: set[concurrent.futures.Future[Any]] = set()
        self._checked: dict[str, Any] = {}
        #: Occurrences this scheduler skipped: another one ran them (their done marker
        #: was there), or still held their claim when the takeover window ended.
        self.skipped = 0
        #: Occurrences this scheduler claimed (and handed to the inner executor).
        self.claimed = 0
        #: Of those, the ones it took over: it got the claim only after waiting for it.
        self.taken_over = 0

    @property
    def backend(self) -> asynclock.Backend:
        """The open backend. It lives on the executor's own event-loop thread: call it
        only from there."""
        return self._loop_thread.require()[1]

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, scheduler: Any, alias: str) -> None:
        # Refuse misconfigured jobs before anything runs (jobs added before start wait in
        # the scheduler's pending list; later ones are checked when first submitted).
        loop = getattr(scheduler, "_eventloop", None)
        self._scheduler_loop = loop if isinstance(loop, asyncio.AbstractEventLoop) else None
        for job, _store, _replace in getattr(scheduler, "_pending_jobs", ()):
            if job.executor == alias:
                self._check(job)
        super().start(scheduler, alias)
        if self._inner is None:
            self._inner = AsyncIOExecutor() if self._scheduler_loop else ThreadPoolExecutor()
        self._loop_thread.open()
        try:
            self._inner.start(scheduler, alias)
        except BaseException:
            self._loop_thread.close()
            raise

    def shutdown(self, wait: bool = True) -> None:
        for claim in list(self._claims):
            claim.cancel()
        if self._inner is not None:
            self._inner.shutdown(wait)
        self._loop_thread.close()

    # -- submission (the scheduler's thread) ------------------------------------------------

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        key = repr((job.trigger, job.misfire_grace_time))
        if self._checked.get(job.id) != key:
            self._check(job)
            self._checked[job.id] = key
        thread, _ = self._loop_thread.require()
        for run_time in run_times:
            claim = thread.submit(self._claim(job, run_time))
            self._claims.add(claim)
            claim.add_done_callback(functools.partial(self._claimed, job, run_time))

    def _check(self, job: Any) -> None:
        check_job(
            job,
            claim_ttl=self.claim_ttl,
            clock_skew=self.clock_skew,
            takeover_window=self.takeover_window,
        )
        self._check_func(job)

    def _check_func(self, job: Any) -> None:
        if self._scheduler_loop is None and asyncio.iscoroutinefunction(job.func):
            raise ValueError(
                f"job {job.id!r}: {job.func.__qualname__} is a coroutine function, which only "
                "an AsyncIOScheduler runs; use AsyncIOScheduler, or a plain function here"
            )

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        raise AssertionError("ClaimingExecutor.submit_job hands jobs to its inner executor")

    async def _claim(self, job: Any, run_time: datetime) -> _Claim | None:
        late = datetime.now(UTC) - run_time
        if job.misfire_grace_time is not None and late > timedelta(seconds=job.misfire_grace_time):
            self._missed(job, run_time, f"it is {late} late")
            return None
        window, done_ttl = takeover_bounds(
            job,
            claim_ttl=self.claim_ttl,
            clock_skew=self.clock_skew,
            takeover_window=self.takeover_window,
        )
        window_end = run_time + timedelta(seconds=window)
        done = done_name(job.id, run_time)
        outcome = await get_claim(
            self._loop_thread.require()[1],
            occurrence_name(job.id, run_time),
            ttl=self.claim_ttl,
            scope=job.id,
            done=done,
            start_by=start_by(job, run_time, self.clock_skew),
            window_end=window_end,
        )
        if isinstance(outcome, Missed):
            self._missed(job, run_time, outcome.why)
            return None
        if isinstance(outcome, Skipped):
            self.skipped += 1
            logger.debug("skipping occurrence %s of %s: %s", run_time, job, outcome.why)
            return None
        permit: InstancePermit | None = None
        if self.fleet_max_instances:
            permit = await self._instance(
                job, run_time, outcome.lease, done, done_ttl, window_end, outcome.waited
            )
            if permit is None:
                return None
        return _Claim(
            outcome.lease, done, done_ttl, outcome.waited, monotonic_deadline(window_end), permit
        )

    async def _instance(
        self,
        job: Any,
        run_time: datetime,
        lease: asynclock.Lease,
        done: str,
        done_ttl: float,
        window_end: datetime,
        waited: bool,
    ) -> InstancePermit | None:
        """One of the job's fleet-wide instance permits, or None: every one is held, the
        occurrence is skipped (as at max_instances) and marked done for the fleet."""
        backend = self._loop_thread.require()[1]
        # A takeover waits (a dead claimant's permit frees with its claim); else at once.
        timeout = max(0.0, (window_end - datetime.now(UTC)).total_seconds()) if waited else None
        try:
            return await InstancePermit.take(
                backend, job.id, job.max_instances, ttl=self.claim_ttl, timeout=timeout
            )
        except (asynclock.LockHeld, asynclock.AcquireTimeout):
            pass
        except BaseException:
            await lease.release()
            raise
        self._logger.warning(
            'Execution of job "%s" skipped: maximum number of running instances reached (%d)',
            job,
            job.max_instances,
        )
        self._dispatch(
            JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, job.id, job._jobstore_alias, [run_time])
        )
        self.skipped += 1
        await record_done(backend, lease, done, done_ttl)
        return None

    def _missed(self, job: Any, run_time: datetime, why: str) -> None:
        self._dispatch(JobExecutionEvent(EVENT_JOB_MISSED, job.id, job._jobstore_alias, run_time))
        self._logger.warning('Run time of job "%s" was missed (%s): %s', job, run_time, why)

    def _claimed(self, job: Any, run_time: datetime, done: concurrent.futures.Future[Any]) -> None:
        """On the executor's loop thread, when a claim attempt has finished."""
        self._claims.discard(done)
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            logger.error("claiming occurrence %s of %s failed: %r", run_time, job, error)
            self._dispatch(
                JobExecutionEvent(
                    EVENT_JOB_ERROR, job.id, job._jobstore_alias, run_time, exception=error
                )
            )
            return
        claim: _Claim | None = done.result()
        if claim is None:
            return
        lease = claim.lease
        self.claimed += 1
        if claim.waited:
            self.taken_over += 1
            logger.info("taking over occurrence %s of %s (token %d)", run_time, job, lease.token)
        permit = claim.permit.permit if claim.permit is not None else None
        occurrence = Occurrence(job.id, run_time, lease, permit)
        if asyncio.iscoroutinefunction(job.func):
            func: Callable[..., Any] = self._async_runner(job.func, occurrence, claim)
        else:
            func = self._sync_runner(job.func, occurrence, claim)
        unit = _OccurrenceJob(job, func)

        def submit() -> None:
            assert self._inner is not None
            try:
                self._inner.submit_job(unit, [run_time])
            except MaxInstancesReachedError:
                waits = claim.waited or claim.permit is not None
                if waits and not lease.lost and time.monotonic() < claim.deadline:
                    # A takeover arrives late, often while this node runs a later
                    # occurrence: hold the claim (renewed) until a slot is free. With a
                    # fleet permit, a local run has ended (its permit is back) and is
                    # only not yet counted out by APScheduler: a moment's wait.
                    self._later(_SLOT_POLL, submit)
                    return
                self._logger.warning(
                    'Execution of job "%s" skipped: maximum number of running instances '
                    "reached (%d)",
                    job,
                    job.max_instances,
                )
                self._dispatch(
                    JobSubmissionEvent(
                        EVENT_JOB_MAX_INSTANCES, job.id, job._jobstore_alias, [run_time]
                    )
                )
                self._give_up(claim)
            except BaseException:
                self._logger.exception(
                    "handing occurrence %s of %s to the executor failed", run_time, job
                )
                self._give_up(claim)

        if self._scheduler_loop is not None:
            self._scheduler_loop.call_soon_threadsafe(submit)
        else:
            # Off the lock loop's thread (this done callback runs on it): the hand-over
            # to the inner executor must not stall the loop that renews every claim.
            self._later(0.0, submit)

    def _later(self, delay: float, call: Callable[[], None]) -> None:
        """Call ``call`` in ``delay`` seconds where ``submit`` runs (the scheduler's loop,
        or any thread for a thread-pool scheduler)."""
        loop = self._scheduler_loop
        if loop is not None:
            loop.call_later(delay, call)
        else:
            timer = threading.Timer(delay, call)
            timer.daemon = True
            timer.start()

    def _give_up(self, claim: _Claim) -> None:
        """The occurrence will not run here: release the claim so another node may."""
        if claim.permit is not None:
            claim.permit.end()
        thread = self._loop_thread.thread
        if thread is not None:  # from any thread, the loop's own too
            thread.submit(claim.lease.release())

    def _dispatch(self, event: Any) -> None:
        if self._scheduler is not None:
            self._scheduler._dispatch_event(event)

    # -- running (the inner executor's thread or task) ---------------------------------------

    def _finish(self, claim: _Claim) -> concurrent.futures.Future[Any] | None:
        """After the run: record the done marker and release the claim; a lost claim is
        left to expire (a waiter then takes the occurrence over)."""
        if claim.permit is not None:
            claim.permit.end()
        thread, backend = self._loop_thread.thread, self._loop_thread.backend
        if thread is None or backend is None or claim.lease.lost:
            return None
        return thread.submit(record_done(backend, claim.lease, claim.done, claim.done_ttl))

    def _sync_runner(
        self, func: Callable[..., Any], occurrence: Occurrence, claim: _Claim
    ) -> Callable[..., Any]:
        thread, _ = self._loop_thread.require()
        return sync_runner(thread, func, occurrence, lambda: self._finish(claim), self._tracer)

    def _async_runner(
        self, func: Callable[..., Any], occurrence: Occurrence, claim: _Claim
    ) -> Callable[..., Any]:
        thread, _ = self._loop_thread.require()
        return async_runner(thread, func, occurrence, lambda: self._finish(claim), self._tracer)


_SLOT_POLL = 0.05  # seconds between hand-over attempts of a takeover waiting for a slot


@dataclass(frozen=True, slots=True)
class _Claim:
    """A claim got, and what finishing its occurrence needs."""

    lease: asynclock.Lease
    done: str  # the done marker's name
    done_ttl: float
    waited: bool  # got only after waiting: a takeover
    deadline: float  # time.monotonic() when the takeover window ends
    permit: InstancePermit | None = None  # fleet_max_instances: the run's instance permit
