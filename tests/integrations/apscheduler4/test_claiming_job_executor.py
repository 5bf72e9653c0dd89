"""asynclock_apscheduler4 against a real APScheduler 4 scheduler (memory data store) and
a real SQLite lock file. Run by tests/test_apscheduler4.py in the apscheduler4 env."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from apscheduler import AsyncScheduler, JobOutcome, JobReleased, current_job
from apscheduler.executors.subprocess import ProcessPoolJobExecutor
from apscheduler.executors.thread import ThreadPoolJobExecutor
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

import asynclock
from asynclock_apscheduler4 import ClaimingJobExecutor, occurrence_name

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


class Released:
    """JobReleased events, with a condition to wait on."""

    def __init__(self) -> None:
        self.events: list[JobReleased] = []
        self._changed = anyio.Event()

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, count: int) -> None:
        while len(self.events) < count:
            await self._changed.wait()


async def test_each_run_holds_a_claim_whose_token_rises_with_the_fire_time(url: str) -> None:
    seen: list[tuple[str, int, datetime, bool]] = []

    async def tick() -> None:
        claim = asynclock.current_lease()
        job = current_job.get()
        assert job.original_scheduled_time is not None
        seen.append(
            (
                claim.name,
                claim.token,
                job.original_scheduled_time,
                asynclock.current_lease() is claim,
            )
        )

    released = Released()
    with anyio.fail_after(30):
        async with AsyncScheduler(
            job_executors={"async": ClaimingJobExecutor(url, claim_ttl=5)}
        ) as scheduler:
            scheduler.subscribe(released, {JobReleased})
            # A local function needs a task id of its own (APScheduler 4 refers to tasks).
            await scheduler.configure_task("tick", func=tick)
            await scheduler.add_schedule("tick", IntervalTrigger(seconds=0.4), id="tick")
            await scheduler.start_in_background()
            await released.until(3)
            await scheduler.stop()
    assert [e.outcome for e in released.events[:3]] == [JobOutcome.success] * 3
    assert len(seen) >= 3 and all(same for *_, same in seen)
    for name, _, fire_time, _ in seen:
        assert name == f"tick@{fire_time.astimezone(UTC).isoformat()}"
    tokens = [token for _, token, _, _ in sorted(seen, key=lambda s: s[2])]
    assert tokens == sorted(set(tokens))
    with pytest.raises(LookupError, match="no asynclock lease is held"):
        asynclock.current_lease()


async def test_a_lost_claim_cancels_an_async_job_which_ends_with_lease_lost(url: str) -> None:
    executor = ClaimingJobExecutor(url, claim_ttl=5)
    started = anyio.Event()
    cancelled: list[bool] = []

    async def forever() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        except BaseException:
            cancelled.append(True)
            raise

    released = Released()
    with anyio.fail_after(30):
        async with AsyncScheduler(job_executors={"async": executor}) as scheduler:
            scheduler.subscribe(released, {JobReleased})
            await scheduler.start_in_background()
            await scheduler.configure_task("forever", func=forever)
            job_id = await scheduler.add_job("forever", result_expiration_time=60)
            await started.wait()
            # Another party removes the claim (an operator, or its expiry on the server):
            # the holder loses it and the scheduler's run is cancelled.
            (name,) = [lease.name for lease in executor.backend.held()]
            assert await executor.backend.break_lock(name)
            result = await scheduler.get_job_result(job_id)
            await scheduler.stop()
    assert cancelled == [True]
    assert result is not None and result.outcome is JobOutcome.error
    assert isinstance(result.exception, asynclock.LeaseLost)
    assert result.exception.name == name


async def test_a_lost_claim_interrupts_a_thread_pool_job(url: str) -> None:
    executor = ClaimingJobExecutor(url, claim_ttl=5, inner=ThreadPoolJobExecutor())
    started = threading.Event()
    interrupted: list[int] = []
    claimed: list[int] = []

    def busy() -> None:
        claimed.append(asynclock.current_lease().token)  # the claim's context reaches here
        started.set()
        try:
            for _ in range(3000):
                time.sleep(0.01)
        except asynclock.LeaseLost as lost:
            interrupted.append(lost.token)
            raise

    with anyio.fail_after(30):
        async with AsyncScheduler(job_executors={"threadpool": executor}) as scheduler:
            await scheduler.start_in_background()
            await scheduler.configure_task("busy", func=busy)
            job_id = await scheduler.add_job("busy", result_expiration_time=60)
            await anyio.to_thread.run_sync(started.wait, 20)
            (lease,) = executor.backend.held()
            token = lease.token
            assert await executor.backend.break_lock(lease.name)
            result = await scheduler.get_job_result(job_id)
            await scheduler.stop()
    assert interrupted == [token] and claimed == [token]
    assert result is not None and result.outcome is JobOutcome.error
    assert isinstance(result.exception, asynclock.LeaseLost)


async def test_an_occurrence_claimed_elsewhere_does_not_run_here(url: str) -> None:
    """APScheduler 4 hands a job whose data-store lease lapsed to another scheduler; the
    claim keeps the second run out: the job ends with LockHeld and its body never runs."""
    ran: list[bool] = []

    async def once() -> None:
        ran.append(True)

    fire_time = (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0)
    released = Released()
    with anyio.fail_after(30):
        async with asynclock.connect(url) as other:  # another scheduler's backend
            async with AsyncScheduler(
                job_executors={"async": ClaimingJobExecutor(url, claim_ttl=5)}
            ) as scheduler:
                scheduler.subscribe(released, {JobReleased})
                await scheduler.configure_task("once", func=once)
                await scheduler.add_schedule("once", DateTrigger(fire_time), id="once")
                async with other.lock(f"once@{fire_time.isoformat()}", ttl=20, token_scope="once"):
                    await scheduler.start_in_background()
                    await released.until(1)
                await scheduler.stop()
    (event,) = released.events
    assert event.outcome is JobOutcome.error
    assert event.exception_type is not None and event.exception_type.endswith("LockHeld")
    assert ran == []


def flatten(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in flatten(inner)]
    return [error]


async def test_a_claim_that_outlasts_half_the_schedulers_lease_is_refused_at_start(
    url: str,
) -> None:
    executor = ClaimingJobExecutor(url, claim_ttl=15)  # + 1 s skew >= 30 s / 2
    with anyio.fail_after(20), pytest.raises(BaseException) as caught:
        async with AsyncScheduler(job_executors={"async": executor}) as scheduler:
            await scheduler.run_until_stopped()
    (error,) = [e for e in flatten(caught.value) if isinstance(e, ValueError)]
    assert "must be under half the scheduler's lease_duration (15s)" in str(error)
    # Within the bound it starts (and stops).
    with anyio.fail_after(20):
        async with AsyncScheduler(
            job_executors={"async": ClaimingJobExecutor(url, claim_ttl=5)}, lease_duration=20
        ) as scheduler:
            await scheduler.start_in_background()
            await scheduler.stop()


def test_occurrence_name_without_a_schedule_uses_the_job_id() -> None:
    from apscheduler import Job

    job = Job(task_id="mod:func", executor="async")
    assert occurrence_name(job) == f"mod:func@{job.id}"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("localhost",), {"claim_ttl": 5}, ValueError, "lock URL like"),
        ((3,), {"claim_ttl": 5}, TypeError, "url_or_backend must be"),
        (("memory://",), {"claim_ttl": -1}, ValueError, "claim_ttl must be a finite"),
        (("memory://",), {"claim_ttl": "5"}, TypeError, "claim_ttl must be a number"),
        (
            ("memory://",),
            {"claim_ttl": 5, "inner": ProcessPoolJobExecutor()},
            TypeError,
            "inner must run jobs in this process",
        ),
        (("memory://",), {"claim_ttl": 5, "inner": object()}, TypeError, "inner must be an"),
        (("memory://",), {"claim_ttl": 5, "clock_skew": -1}, ValueError, "clock_skew"),
    ],
)
def test_bad_arguments_are_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ClaimingJobExecutor(*args, **kwargs)


def test_the_integration_exports_what_it_documents() -> None:
    import asynclock_apscheduler4

    assert set(asynclock_apscheduler4.__all__) == {
        "ClaimingJobExecutor",
        "occurrence_name",
    }
    assert all(hasattr(asynclock_apscheduler4, name) for name in asynclock_apscheduler4.__all__)
