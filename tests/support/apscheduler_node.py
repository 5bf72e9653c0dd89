"""One APScheduler process of a fleet, claiming occurrences through ClaimingExecutor.

Driven by tests through argv (JSON) and stdin ("status", "stop", "at <ISO time>": add the
job now, on a date trigger at that time, for a "date" trigger without run_date; "pause":
fire nothing new; "drain": wait until every claim this node made or waits for has ended,
so a "stop" after it interrupts no run); prints JSON events:
  started      the scheduler runs
  paused       the scheduler fires nothing new (any submission under way has ended)
  drained      no claim of this node pending, every occurrence it claimed has ended
  job_started  a job body began: run_time, token (the claim's), pid
  ran          a job body finished its fenced write: run_time, token, result
  late_write   a job whose claim was lost replayed its write: result ("stale"/"accepted")
  job_error    APScheduler's EVENT_JOB_ERROR: exception type and reason
  missed       APScheduler's EVENT_JOB_MISSED: run_time (the scheduler's or the executor's)
  status       claimed / skipped / taken_over counts of the executor
  stopped      after shutdown
Config: url, options, kind ("background": sync job in a thread pool, "asyncio": async
job), job_id, trigger ("cron": every second; "date": once at run_date), claim_ttl,
grace, skew, work (seconds the body runs; -1: until its claim is lost), ledger (SQLite
file written through SQLFence, fence key = job id, or the occurrence's claim name with
"fence": "occurrence"); optional: late (seconds this node submits each occurrence late,
as a scheduler whose clock is behind), max_instances (default 1), takeover_window,
stop_wait (a background node's "stop" shuts down with wait=True), fleet_max_instances
(the executor's option; a skip at max_instances is told as "max_instances").
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from datetime import datetime
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger

import asynclock
from asynclock_apscheduler import ClaimingExecutor, current_occurrence
from tests.support.worker import fenced_write

CFG: dict[str, Any] = json.loads(sys.argv[1])
OUT = threading.Lock()


def emit(**event: Any) -> None:
    with OUT:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


def occurrence() -> tuple[str, int]:
    occurrence = current_occurrence()
    assert asynclock.current_lease() is occurrence.lease
    return occurrence.run_time.isoformat(), occurrence.token


def began(run_time: str, token: int) -> None:
    emit(event="job_started", run_time=run_time, token=token, pid=os.getpid(), at=time.time())


def write(run_time: str, token: int, late: bool = False) -> None:
    key = CFG["job_id"]
    if CFG.get("fence") == "occurrence":
        key = f"{key}@{run_time}"
    result = fenced_write(CFG["ledger"], key, token, run_time)
    emit(
        event="late_write" if late else "ran",
        run_time=run_time,
        token=token,
        result=result,
        at=time.time(),
    )


#: How many job bodies have ended in this node; notified on that and whenever a claim
#: attempt settles, so "drain" waits on events alone.
ENDED = [0]
CHANGED = threading.Condition()


def ended() -> None:
    with CHANGED:
        ENDED[0] += 1
        CHANGED.notify_all()


def wait_drained(executor: ClaimingExecutor, timeout: float = 30.0) -> None:
    """Until no claim of this node is pending and every occurrence it claimed has run."""
    with CHANGED:
        if not CHANGED.wait_for(
            lambda: not executor._claims and executor.claimed == ENDED[0], timeout
        ):
            raise SystemExit(
                f"not drained after {timeout:g}s: {len(executor._claims)} claims pending, "
                f"{executor.claimed} claimed, {ENDED[0]} ended"
            )
    emit(event="drained")


def sync_job() -> None:
    run_time, token = occurrence()
    try:
        # Inside the try: a test freezes the node as soon as it reads job_started, and
        # the interruption after the thaw must land where it is caught.
        began(run_time, token)
        deadline = time.monotonic() + (CFG["work"] if CFG["work"] >= 0 else 3600)
        while time.monotonic() < deadline:
            time.sleep(0.02)  # short sleeps: the interruption lands between them
    except asynclock.LeaseLost:
        write(run_time, token, late=True)
        raise
    else:
        write(run_time, token)
    finally:
        ended()  # after its write: a drained node has nothing left to say


async def async_job() -> None:
    run_time, token = occurrence()
    began(run_time, token)
    try:
        await asyncio.sleep(CFG["work"] if CFG["work"] >= 0 else 3600)
    except asyncio.CancelledError:
        write(run_time, token, late=True)
        raise
    else:
        write(run_time, token)
    finally:
        ended()


def on_error(event: Any) -> None:
    exc = event.exception
    emit(
        event="job_error",
        exception=type(exc).__name__,
        reason=getattr(exc, "reason", str(exc)),
        run_time=event.scheduled_run_time.isoformat(),
    )


def on_missed(event: Any) -> None:
    emit(event="missed", run_time=event.scheduled_run_time.isoformat())


def on_max_instances(event: Any) -> None:
    emit(event="max_instances", run_times=[t.isoformat() for t in event.scheduled_run_times])


def build(scheduler: Any, executor: ClaimingExecutor) -> None:
    scheduler.add_executor(executor, "default")
    if CFG["trigger"] == "cron":
        add_job(scheduler, CronTrigger(second="*", timezone="UTC"))
    elif CFG.get("run_date"):
        add_job(scheduler, DateTrigger(run_date=datetime.fromisoformat(CFG["run_date"])))
    scheduler.add_listener(on_error, EVENT_JOB_ERROR)
    scheduler.add_listener(on_missed, EVENT_JOB_MISSED)
    scheduler.add_listener(on_max_instances, EVENT_JOB_MAX_INSTANCES)


def add_job(scheduler: Any, trigger: Any) -> None:
    scheduler.add_job(
        async_job if CFG["kind"] == "asyncio" else sync_job,
        trigger,
        id=CFG["job_id"],
        misfire_grace_time=int(CFG["grace"]),
        coalesce=True,
        max_instances=CFG.get("max_instances", 1),
    )


def command(line: str, scheduler: Any, executor: ClaimingExecutor) -> bool:
    line = line.strip()
    if line.startswith("at "):
        add_job(scheduler, DateTrigger(run_date=datetime.fromisoformat(line[3:])))
        return True
    if line == "pause":
        scheduler.pause()
        # A background scheduler submits due jobs under this lock: once we hold it, any
        # submission begun before the pause has ended (APScheduler 3's own lock).
        with scheduler._jobstores_lock:
            pass
        emit(event="paused")
        return True
    if line == "status":
        emit(
            event="status",
            claimed=executor.claimed,
            skipped=executor.skipped,
            taken_over=executor.taken_over,
        )
        return True
    return bool(line) and line != "stop"


class NodeExecutor(ClaimingExecutor):
    """Tells "drain" when a claim attempt has settled (granted, skipped, cancelled)."""

    def _claimed(self, *args: Any) -> None:
        super()._claimed(*args)
        with CHANGED:
            CHANGED.notify_all()


class LateExecutor(NodeExecutor):
    """Submits every occurrence ``late`` seconds after the scheduler does."""

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        submit = super().submit_job
        timer = threading.Timer(CFG["late"], submit, (job, run_times))
        timer.daemon = True
        timer.start()


def make_executor() -> ClaimingExecutor:
    backend = asynclock.connect(CFG["url"], **CFG.get("options", {}))
    kind = LateExecutor if CFG.get("late") else NodeExecutor
    return kind(
        backend,
        claim_ttl=CFG["claim_ttl"],
        clock_skew=CFG["skew"],
        takeover_window=CFG.get("takeover_window"),
        fleet_max_instances=CFG.get("fleet_max_instances", False),
    )


def run_background() -> None:
    executor = make_executor()
    scheduler = BackgroundScheduler(timezone="UTC")
    build(scheduler, executor)
    scheduler.start()
    emit(event="started", pid=os.getpid())
    while True:
        line = sys.stdin.readline()
        if line.strip() == "drain":
            wait_drained(executor)
        elif not command(line, scheduler, executor):
            break
    scheduler.shutdown(wait=bool(CFG.get("stop_wait")))
    emit(event="stopped")


async def run_asyncio() -> None:
    executor = make_executor()
    scheduler = AsyncIOScheduler(timezone="UTC")
    build(scheduler, executor)
    scheduler.start()
    emit(event="started", pid=os.getpid())
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if line.strip() == "drain":
            await asyncio.to_thread(wait_drained, executor)  # the loop runs the jobs
        elif not command(line, scheduler, executor):
            break
    scheduler.shutdown(wait=False)
    emit(event="stopped")


if __name__ == "__main__":
    if CFG["kind"] == "asyncio":
        asyncio.run(run_asyncio())
    else:
        run_background()
    sys.stdout.flush()
    os._exit(0)  # a sync job interrupted mid-sleep must not hold the exit up
