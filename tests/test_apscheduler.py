"""asynclock_apscheduler: occurrences run once across real scheduler processes (issue 12)."""

from __future__ import annotations

import json
import logging
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
)
from apscheduler.executors.pool import ProcessPoolExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

import asynclock
from asynclock._harness import Worker, WorkerFailed, WorkerGroup
from asynclock_apscheduler import (
    ClaimingExecutor,
    check_job,
    current_occurrence,
    leader_only,
)
from tests.support.procs import EVENT_TIMEOUT
from tests.support.redis_servers import RedisFactory, RedisServer
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]


async def start_node(spec: BackendSpec, group: WorkerGroup, **config: Any) -> Worker:
    """One scheduler process (tests/support/apscheduler_node.py), in ``group``: killed and
    reaped on the test's own event loop when the group's block ends, even on a failure."""
    payload = json.dumps({"url": spec.url, "options": spec.options, **config})
    return await group.start(
        ["-m", "tests.support.apscheduler_node", payload],
        label=f"scheduler node ({spec.id})",
        timeout=EVENT_TIMEOUT,
    )


class Events:
    """Every event of every node, with a condition to wait on."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, Any]]] = []
        self._changed = anyio.Event()

    async def pump(self, index: int, node: Worker) -> None:
        while True:
            try:
                event = await node.next_event()
            except WorkerFailed:  # it exited (or said nothing for EVENT_TIMEOUT)
                return
            self.seen.append((index, event))
            self._changed.set()
            self._changed = anyio.Event()
            if event["event"] == "stopped":
                return

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    def of(self, kind: str, node: int | None = None) -> list[dict[str, Any]]:
        return [e for i, e in self.seen if e["event"] == kind and node in (None, i)]


def ledger_rows(path: Path) -> list[tuple[str, int]]:
    conn = sqlite3.connect(path)
    try:
        return [(str(w), int(t)) for w, t in conn.execute("SELECT writer, token FROM ledger")]
    finally:
        conn.close()


def node_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": f"job-{uuid.uuid4().hex[:8]}",
        "trigger": "cron",
        "claim_ttl": 5.0,
        "grace": 2.0,
        "skew": 0.5,
        "work": 0.0,
        "ledger": str(tmp_path / "ledger.db"),
        **extra,
    }


@dataclass
class Fleet:
    """What a fleet run saw: every node's events, its config, the counted run times."""

    events: Events
    config: dict[str, Any]
    began: datetime  # the first run time after the first node started
    first: datetime  # the first run time after all three started
    last: datetime


async def run_fleet(
    spec: BackendSpec,
    tmp_path: Path,
    kind: str,
    occurrences: int = 20,
    *,
    fault: Callable[[], None] | None = None,
    **extra: Any,
) -> Fleet:
    """Three scheduler processes on one every-second cron schedule, until ``occurrences``
    of it have run (with ``fault``: run in a thread once 3 have run and a node runs the
    next, then ``occurrences`` more), stopped gracefully."""
    await anyio.Path(tmp_path).mkdir()
    config = node_config(tmp_path, kind=kind, work=0.3, **extra)
    events = Events()
    # The group kills and reaps the nodes if this fleet fails or another fleet's failure
    # cancels it (on this event loop, so no process transport outlives it).
    async with WorkerGroup() as group:
        async with anyio.create_task_group() as tg:
            nodes = [await start_node(spec, group, **config) for _ in range(3)]
            for i, node in enumerate(nodes):
                await node.expect("started")
                if not i:
                    began = (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0)
                tg.start_soon(events.pump, i, node)
            # Count occurrences from the first whole second after all three run.
            first = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
            since = first

            def counted() -> list[datetime]:
                times = {datetime.fromisoformat(e["run_time"]) for e in events.of("ran")}
                return sorted(t for t in times if t >= since)

            def running(after: datetime) -> list[int]:
                # Nodes that began an occurrence after ``after`` (work: 0.3 s).
                later = [e for e in events.of("job_started") if e["run_time"] > after.isoformat()]
                return [e["pid"] for e in later]

            if fault is not None:
                await events.until(lambda: len(counted()) >= 3)
                before = counted()[2]
                await events.until(lambda: bool(running(before)))  # a run is under way
                await anyio.to_thread.run_sync(fault)
                since = datetime.now(UTC)
            await events.until(lambda: len(counted()) >= occurrences)
            last = counted()[occurrences - 1]
            # Begin the stop while a node runs an occurrence: the drain must wait for it.
            await events.until(lambda: bool(running(last)))
            # Stop gracefully: no node fires anything new, then every node finishes
            # what it claimed or waits for. A node stopped in mid-run has its
            # occurrence taken over by design (the takeover tests below); stopping
            # the nodes one by one must not count as that.
            for node in nodes:
                await node.send("pause")
            await events.until(lambda: len(events.of("paused")) == len(nodes))
            await drain_and_stop(events, nodes)
        for node in nodes:
            await node.wait()
    return Fleet(events, config, began, first, last)


async def drain_and_stop(events: Events, nodes: list[Worker]) -> None:
    """Let every node finish what it claimed or waits for, then stop them all."""
    for node in nodes:
        await node.send("drain")
    await events.until(lambda: len(events.of("drained")) == len(nodes))
    for node in nodes:
        await node.send("stop")


def every_second(since: datetime, fleet: Fleet) -> set[str]:
    """The run times of the fleet's schedule from ``since`` to its last counted one."""
    span = int((fleet.last - since).total_seconds())
    return {(since + timedelta(seconds=s)).isoformat() for s in range(span + 1)}


def check_at_most_once(fleet: Fleet, label: str) -> None:
    """No occurrence started twice, anywhere, ever; every run wrote through the job-wide
    fence key (the job id), its token rising with the run time (the job's token scope)."""
    events = fleet.events
    starts = [e["run_time"] for e in events.of("job_started")]
    assert len(starts) == len(set(starts)), f"{label}: an occurrence ran twice: {sorted(starts)}"
    ran = events.of("ran")
    assert all(e["result"] == "accepted" for e in ran), (label, ran)
    by_time = sorted((datetime.fromisoformat(e["run_time"]), e["token"]) for e in ran)
    tokens = [token for _, token in by_time]
    assert tokens == sorted(set(tokens)), (label, by_time)
    # A run whose claim was lost (the server restarted under it) writes once more when it
    # is stopped; the fence accepts that write only if nothing newer was written.
    late = [e for e in events.of("late_write") if e["result"] == "accepted"]
    assert len(ledger_rows(Path(fleet.config["ledger"]))) == len(ran) + len(late), label


async def three_schedulers_exactly_once(
    spec: BackendSpec, tmp_path: Path, kind: str, occurrences: int = 20
) -> None:
    fleet = await run_fleet(spec, tmp_path, kind, occurrences)
    label = f"{spec.id} ({kind} scheduler)"
    check_at_most_once(fleet, label)
    missed = every_second(fleet.first, fleet) - {e["run_time"] for e in fleet.events.of("ran")}
    assert not missed, f"{label}: occurrences missed: {sorted(missed)}"


@pytest.mark.timeout(120)
async def test_three_schedulers_run_every_occurrence_once_on_sqlite_redis_and_postgres(
    spec_sqlite: BackendSpec,
    spec_redis: BackendSpec,
    spec_postgres_lease: BackendSpec,
    tmp_path: Path,
) -> None:
    """The three fleets run at the same time (one test, ~25 s): sync jobs on SQLite and
    PostgreSQL (BackgroundScheduler), async jobs on Redis (AsyncIOScheduler)."""
    with anyio.fail_after(100):
        async with anyio.create_task_group() as tg:
            for spec, kind in (
                (spec_sqlite, "background"),
                (spec_redis, "asyncio"),
                (spec_postgres_lease, "background"),
            ):
                tg.start_soon(three_schedulers_exactly_once, spec, tmp_path / spec.id, kind)


# -- a lock server that lost its data, or is briefly gone ------------------------------------


def server_spec(server: RedisServer) -> BackendSpec:
    async def no_sabotage(backend: asynclock.Backend, name: str) -> None:
        raise AssertionError("not used here")

    return BackendSpec("redis", server.url, no_sabotage)


def check_reported(fleet: Fleet, label: str) -> None:
    """Every occurrence since a node ran was started once, or reported missed (never
    dropped)."""
    started = {e["run_time"] for e in fleet.events.of("job_started")}
    missed = {e["run_time"] for e in fleet.events.of("missed")}
    dropped = every_second(fleet.began, fleet) - started - missed
    assert not dropped, f"{label}: neither run nor reported missed: {sorted(dropped)}"


@pytest.mark.timeout(120)
async def test_three_schedulers_on_a_fresh_redis_run_each_occurrence_at_most_once(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """A just-started redis-server, the documented defaults (no restart_grace option): the
    database's restart grace (the first ttl asked for: a claim's, 10 s after the server
    started) refuses the first claims. Before: several occurrences were claimed together
    when it ended, out of run-time order, and the job-wide fence refused their writes
    (with the grace of each request its own ttl, the done marker was refused too, read as
    "already there", and every node ran every occurrence). Now each runs at most once, in
    run-time order, and one the grace kept from starting in time is reported missed."""
    server = redis_factory(fresh=True)
    with anyio.fail_after(100):
        fleet = await run_fleet(
            server_spec(server), tmp_path / "fleet", "background", 4, claim_ttl=10.0
        )
    check_at_most_once(fleet, "fresh redis")
    check_reported(fleet, "fresh redis")
    assert fleet.events.of("missed"), "the restart grace held nothing up"


@pytest.mark.timeout(150)
async def test_three_schedulers_across_a_redis_restart_without_persistence(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """kill -9 of the redis-server while a node runs an occurrence, restarted at once
    without its data (the done markers and claims are gone; its grace begins): no
    occurrence runs twice, each one not run is reported missed, and the fleet runs its
    schedule again once the grace is over."""
    server = redis_factory(fresh=True)

    def restart() -> None:
        server.restart(keep_data=False)

    with anyio.fail_after(130):
        fleet = await run_fleet(
            server_spec(server), tmp_path / "fleet", "asyncio", 3, fault=restart
        )
    check_at_most_once(fleet, "restarted redis")
    check_reported(fleet, "restarted redis")


async def test_a_waiter_reports_missed_an_occurrence_whose_claim_a_redis_restart_lost(
    redis_factory: RedisFactory,
) -> None:
    """Another node "runs" the occurrence (the test holds its claim) while this scheduler
    waits for it; the redis-server is then killed and restarted without its data: claim
    and done marker are gone, and nobody can tell whether the run finished. Before: the
    waiter failed on the outage (EVENT_JOB_ERROR, the occurrence dropped) or waited
    through the restart grace and ran it again. Now it reports the occurrence missed."""
    server = redis_factory()
    job_id = f"lost-{uuid.uuid4().hex[:6]}"
    run_date = (datetime.now(UTC) + timedelta(seconds=1.5)).replace(microsecond=0)
    ran: list[int] = []
    errors: list[BaseException] = []
    missed = threading.Event()
    executor = ClaimingExecutor(server.url, claim_ttl=2.0, clock_skew=0.5)
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(executor, "default")
    scheduler.add_job(
        lambda: ran.append(current_occurrence().token),
        "date",
        run_date=run_date,
        id=job_id,
        misfire_grace_time=1,
    )
    scheduler.add_listener(lambda event: missed.set(), EVENT_JOB_MISSED)
    scheduler.add_listener(lambda event: errors.append(event.exception), EVENT_JOB_ERROR)
    with anyio.fail_after(30):
        async with asynclock.connect(server.url) as other:
            name = f"{job_id}@{run_date.isoformat()}"
            claimant = await other.acquire(name, ttl=10.0, token_scope=job_id)
            scheduler.start()
            try:
                # After the run time the scheduler waits for the claim (if it had not
                # tried yet, its first attempt meets the grace: the same answer is due).
                await anyio.sleep((run_date - datetime.now(UTC)).total_seconds() + 0.3)
                await anyio.to_thread.run_sync(lambda: server.restart(keep_data=False))
                reported = await anyio.to_thread.run_sync(missed.wait, 10)
            finally:
                scheduler.shutdown()
    assert reported and not errors, errors
    assert ran == [] and executor.claimed == 0
    assert claimant.lost  # with the server's data


async def test_a_claim_attempt_that_finds_redis_briefly_down_is_repeated(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """The redis-server is frozen (SIGSTOP) from just before the run time until past the
    client's socket timeout (1 s, the default): both nodes' first claim attempts fail with
    BackendUnavailable. Before: both logged the failure and nobody ran the occurrence. Now
    they try again, with backoff, and one runs it, once."""
    server = redis_factory()
    spec = server_spec(server)
    config = node_config(tmp_path, kind="background", trigger="date", claim_ttl=2.0, grace=1.0)
    with anyio.fail_after(40):
        async with WorkerGroup() as group:
            nodes = [await start_node(spec, group, **config) for _ in range(2)]
            for node in nodes:
                await node.expect("started")
            run_date = (datetime.now(UTC) + timedelta(seconds=1.5)).replace(microsecond=0)
            for node in nodes:
                await node.send(f"at {run_date.isoformat()}")
            # The fault is timed on the run time (checked below), not a guess at a state.
            await anyio.sleep((run_date - datetime.now(UTC)).total_seconds() - 0.2)
            server.freeze()
            down = datetime.now(UTC)
            try:
                await anyio.sleep((run_date - down).total_seconds() + 1.4)
            finally:
                server.thaw()
            back = datetime.now(UTC)
            assert down < run_date and back - run_date > timedelta(seconds=1.2), "fault mistimed"
            events = Events()
            async with anyio.create_task_group() as tg:
                for i, node in enumerate(nodes):
                    tg.start_soon(events.pump, i, node)
                await events.until(lambda: bool(events.of("ran")))
                await drain_and_stop(events, nodes)  # each settles it: ran, or skipped it
            for node in nodes:
                await node.wait()
    assert not events.of("job_error"), events.of("job_error")
    assert not events.of("missed"), events.of("missed")
    (started,) = events.of("job_started")
    (ran,) = events.of("ran")
    assert started["run_time"] == ran["run_time"] == run_date.isoformat()
    assert ran["result"] == "accepted"
    assert ledger_rows(Path(config["ledger"])) == [(run_date.isoformat(), started["token"])]


async def start_pair(
    group: WorkerGroup,
    spec: BackendSpec,
    tmp_path: Path,
    kind: str,
    first_work: float,
    **extra: Any,
) -> tuple[dict[str, Any], Worker, Worker]:
    """Two nodes on one date-triggered occurrence, added once both run: node 0 claims it
    (node 1 submits it 0.5 s late, as a scheduler with a clock behind, and finds it busy)."""
    config = node_config(tmp_path, kind=kind, trigger="date", claim_ttl=2.0, grace=1.0, **extra)
    first = await start_node(spec, group, **{**config, "work": first_work})
    second = await start_node(spec, group, **{**config, "work": 0.2, "late": 0.5})
    for node in (first, second):
        await node.expect("started")
    run_date = (datetime.now(UTC) + timedelta(seconds=1.5)).replace(microsecond=0)
    for node in (first, second):
        await node.send(f"at {run_date.isoformat()}")
    return config, first, second


async def status(node: Worker) -> dict[str, Any]:
    await node.send("status")
    return await node.expect("status")


@pytest.mark.parametrize("kind", ["background", "asyncio"])
async def test_a_frozen_schedulers_occurrence_is_taken_over_and_its_late_write_fenced(
    spec_sqlite: BackendSpec, tmp_path: Path, kind: str
) -> None:
    """SIGSTOP mid-run past the claim's ttl: the waiting node takes the occurrence over
    with a larger token and writes it; after SIGCONT the frozen run is interrupted (sync:
    an async exception in its thread; async: cancelled), APScheduler reports LeaseLost,
    and its late write is rejected by the fence: one accepted write for the occurrence."""
    events = Events()
    with anyio.fail_after(50):
        async with WorkerGroup() as group:
            async with anyio.create_task_group() as tg:
                config, frozen, healthy = await start_pair(group, spec_sqlite, tmp_path, kind, -1)
                began = await frozen.expect("job_started")
                frozen.signal(signal.SIGSTOP)
                tg.start_soon(events.pump, 0, frozen)
                tg.start_soon(events.pump, 1, healthy)
                # The claim expires under the frozen node; the healthy one takes it over.
                await events.until(lambda: bool(events.of("ran", 1)))
                frozen.signal(signal.SIGCONT)

                def reported() -> bool:
                    late = [
                        e for e in events.of("late_write", 0) if e["run_time"] == began["run_time"]
                    ]
                    errors = [
                        e for e in events.of("job_error", 0) if e["run_time"] == began["run_time"]
                    ]
                    return bool(late and errors)

                await events.until(reported)
                await healthy.send("status")  # answered through the pump
                await events.until(lambda: bool(events.of("status", 1)))
                for node in (frozen, healthy):
                    await node.send("stop")
            for node in (frozen, healthy):
                await node.wait()
    (takeover,) = events.of("job_started", 1)
    assert takeover["run_time"] == began["run_time"]
    assert takeover["token"] > began["token"]
    (ran,) = events.of("ran", 1)
    assert ran["result"] == "accepted" and ran["token"] == takeover["token"]
    (counts,) = events.of("status", 1)
    assert counts["taken_over"] == 1 and counts["claimed"] == 1
    late = [e for e in events.of("late_write", 0) if e["run_time"] == began["run_time"]]
    assert late[0]["result"] == "stale"
    error = next(e for e in events.of("job_error", 0) if e["run_time"] == began["run_time"])
    assert error["exception"] == "LeaseLost"
    assert not events.of("ran", 0)
    assert ledger_rows(Path(config["ledger"])) == [(began["run_time"], takeover["token"])]


async def test_a_killed_schedulers_occurrence_is_taken_over_on_redis(
    spec_redis: BackendSpec, tmp_path: Path
) -> None:
    """kill -9 mid-run: the claim expires on the Redis server, and the waiting node (async
    jobs; its wait: pub/sub + PTTL) takes the occurrence over and writes it once."""
    await killed_node_is_taken_over(spec_redis, tmp_path, "asyncio")


async def test_a_killed_schedulers_occurrence_is_taken_over_on_postgres(
    spec_postgres_lease: BackendSpec, tmp_path: Path
) -> None:
    """The same on the PostgreSQL lease table (sync jobs; the wait: LISTEN + retry)."""
    await killed_node_is_taken_over(spec_postgres_lease, tmp_path, "background")


async def killed_node_is_taken_over(spec: BackendSpec, tmp_path: Path, kind: str) -> None:
    with anyio.fail_after(50):
        async with WorkerGroup() as group:
            config, killed, healthy = await start_pair(group, spec, tmp_path, kind, -1)
            began = await killed.expect("job_started")
            killed.signal(signal.SIGKILL)
            await killed.wait()
            takeover = await healthy.expect("job_started")
            ran = await healthy.expect("ran")
            counts = await status(healthy)
            await healthy.send("stop")
            await healthy.expect("stopped")
            await healthy.wait()
    assert takeover["run_time"] == began["run_time"] and takeover["token"] > began["token"]
    assert ran["result"] == "accepted"
    assert counts["taken_over"] == 1
    assert ledger_rows(Path(config["ledger"])) == [(began["run_time"], takeover["token"])]


async def test_shutdown_with_wait_lets_the_running_occurrence_finish(
    spec_sqlite: BackendSpec, tmp_path: Path
) -> None:
    """``scheduler.shutdown(wait=True)`` of a BackgroundScheduler while an occurrence runs:
    the run finishes and writes (its claim is not lost), then the node stops."""
    config = node_config(tmp_path, kind="background", trigger="date", work=1.0, stop_wait=True)
    with anyio.fail_after(40):
        async with WorkerGroup() as group:
            node = await start_node(spec_sqlite, group, **config)
            await node.expect("started")
            run_date = (datetime.now(UTC) + timedelta(seconds=1.5)).replace(microsecond=0)
            await node.send(f"at {run_date.isoformat()}")
            began = await node.expect("job_started")
            await node.send("stop")
            ran = await node.expect("ran")
            await node.expect("stopped")
            assert await node.wait() == 0
    assert ran["run_time"] == began["run_time"] and ran["result"] == "accepted"
    assert ledger_rows(Path(config["ledger"])) == [(began["run_time"], began["token"])]


async def test_a_finished_occurrence_is_never_run_again_by_a_waiter(
    spec_sqlite: BackendSpec, tmp_path: Path
) -> None:
    """Node 0 runs the occurrence for 1.5 s; node 1 finds the claim busy and waits for
    it; when node 0 finishes it records the done marker and releases the claim, and node
    1, getting the claim, reads the marker and skips the occurrence."""
    with anyio.fail_after(40):
        async with WorkerGroup() as group:
            config, first, waiter = await start_pair(
                group, spec_sqlite, tmp_path, "background", 1.5
            )
            began = await first.expect("job_started")
            await first.expect("ran")
            while True:  # the waiter decides within its takeover window (a few seconds)
                counts = await status(waiter)
                if counts["claimed"] + counts["skipped"]:
                    break
                await anyio.sleep(0.05)
            for node in (first, waiter):
                await node.send("stop")
                await node.expect("stopped")
                await node.wait()
    assert counts == {"event": "status", "claimed": 0, "skipped": 1, "taken_over": 0}
    assert ledger_rows(Path(config["ledger"])) == [(began["run_time"], began["token"])]


async def test_a_late_scheduler_does_not_run_an_occurrence_again(
    spec_sqlite: BackendSpec, tmp_path: Path
) -> None:
    run_date = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    config = node_config(
        tmp_path,
        kind="background",
        trigger="date",
        run_date=run_date.isoformat(),
        claim_ttl=20.0,
        grace=15.0,
    )
    with anyio.fail_after(40):
        async with WorkerGroup() as group:
            first = await start_node(spec_sqlite, group, **config)
            await first.expect("started")
            await first.expect("job_started")
            await first.expect("ran")
            # Starts after the run, well within the misfire grace time: it submits the
            # occurrence at once, finds the claim kept, and skips it.
            late = await start_node(spec_sqlite, group, **config)
            await late.expect("started")
            while True:
                await late.send("status")
                status = await late.expect("status")
                if status["claimed"] + status["skipped"]:
                    break
                await anyio.sleep(0.05)
            assert status == {"event": "status", "claimed": 0, "skipped": 1, "taken_over": 0}
            for node in (first, late):
                await node.send("stop")
                await node.expect("stopped")
                await node.wait()
    assert len(ledger_rows(Path(config["ledger"]))) == 1


# -- in one process -------------------------------------------------------------------------


def test_async_job_sees_its_claim_and_runs_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    seen: list[tuple[str, int, bool]] = []
    done: anyio.Event | None = None

    async def job() -> None:
        occurrence = current_occurrence()
        lease = asynclock.current_lease()
        seen.append((occurrence.lease.name, occurrence.token, lease is occurrence.lease))
        assert done is not None
        done.set()

    async def main() -> None:
        nonlocal done
        done = anyio.Event()
        scheduler = AsyncIOScheduler(timezone="UTC")
        scheduler.add_executor(ClaimingExecutor(url, claim_ttl=5.0), "default")
        start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
        scheduler.add_job(job, "date", run_date=start, id="report", misfire_grace_time=2)
        scheduler.start()
        try:
            with anyio.fail_after(10):
                await done.wait()
        finally:
            scheduler.shutdown(wait=False)

    with pytest.raises(LookupError, match="ClaimingExecutor"):
        current_occurrence()
    anyio.run(main)
    ((name, token, same),) = seen
    assert name.startswith("report@") and name.endswith("+00:00") and token >= 1 and same


def test_each_run_is_a_span_with_its_claims_token(tmp_path: Path) -> None:
    """With OpenTelemetry, every run (thread pool and asyncio) is a span ``run {job id}``,
    current in the job, with the claim's token and the run time."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    tokens: dict[str, int] = {}
    ran = threading.Event()

    def sync_job() -> None:
        assert trace.get_current_span().is_recording()
        tokens["sync"] = current_occurrence().token
        ran.set()

    async def async_job() -> None:
        assert trace.get_current_span().is_recording()
        tokens["async"] = current_occurrence().token

    start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    background = BackgroundScheduler(timezone="UTC")
    background.add_executor(ClaimingExecutor(url, claim_ttl=5.0, tracer_provider=provider))
    background.add_job(sync_job, "date", run_date=start, id="sync-job", misfire_grace_time=2)
    background.start()
    try:
        assert ran.wait(10)
    finally:
        background.shutdown(wait=True)

    async def main() -> None:
        done = anyio.Event()
        scheduler = AsyncIOScheduler(timezone="UTC")
        scheduler.add_executor(ClaimingExecutor(url, claim_ttl=5.0, tracer_provider=provider))
        when = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)

        async def job() -> None:
            await async_job()
            done.set()

        scheduler.add_job(job, "date", run_date=when, id="async-job", misfire_grace_time=2)
        scheduler.start()
        try:
            with anyio.fail_after(10):
                await done.wait()
        finally:
            scheduler.shutdown(wait=False)

    anyio.run(main)
    spans = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
    assert spans["run sync-job"]["asynclock.lease.token"] == tokens["sync"]
    assert spans["run sync-job"]["apscheduler.run_time"] == start.isoformat()
    assert spans["run async-job"]["asynclock.lease.token"] == tokens["async"]
    assert spans["run async-job"]["apscheduler.job.id"] == "async-job"


def test_a_sync_job_whose_claim_is_lost_is_interrupted_with_lease_lost(
    spec_sqlite: BackendSpec,
) -> None:
    started, reported = threading.Event(), threading.Event()
    claimed: list[str] = []
    errors: list[BaseException] = []
    swallowed: list[bool] = []

    def job() -> None:
        claimed.append(current_occurrence().lease.name)
        token = current_occurrence().token
        started.set()
        try:
            for _ in range(1000):
                time.sleep(0.01)
        except asynclock.LeaseLost as lost:
            # It names the claim; swallowing it does not make the run a success.
            swallowed.append(lost.name == claimed[0] and lost.token == token)

    def on_error(event: Any) -> None:
        errors.append(event.exception)
        reported.set()

    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(ClaimingExecutor(spec_sqlite.url, claim_ttl=3.0), "default")
    run_date = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
    scheduler.add_job(job, "date", run_date=run_date, id=f"j-{uuid.uuid4().hex[:6]}")
    scheduler.add_listener(on_error, EVENT_JOB_ERROR)
    scheduler.start()
    try:
        assert started.wait(10)
        conn = sqlite3.connect(spec_sqlite.url.removeprefix("sqlite:///"), timeout=5)
        conn.execute("UPDATE asynclock_lease SET expires_at = 0 WHERE name = ?", (claimed[0],))
        conn.commit()
        conn.close()
        assert reported.wait(10), "the job was not stopped"
    finally:
        scheduler.shutdown(wait=False)
    assert swallowed == [True]
    (error,) = errors
    assert isinstance(error, asynclock.LeaseLost) and "refused" in error.reason


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll a condition another thread changes (the executor's counters carry no event)."""
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True


def two_occurrences(
    url: str, job: Callable[[], None], job_id: str, first: datetime, second: datetime
) -> tuple[ClaimingExecutor, BackgroundScheduler]:
    """A scheduler (not started) whose job runs at ``first`` and ``second``, one at a time."""
    executor = ClaimingExecutor(url, claim_ttl=2.0, clock_skew=0.5)
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(executor, "default")
    scheduler.add_job(
        job,
        CronTrigger(second="*", start_date=first, end_date=second, timezone="UTC"),
        id=job_id,
        misfire_grace_time=1,
        max_instances=1,
    )
    return executor, scheduler


def test_a_takeover_waits_for_a_free_instance_slot_holding_its_claim(
    spec_sqlite: BackendSpec,
) -> None:
    """max_instances=1 and the node runs occurrence 1 when it takes over occurrence 2 (its
    claimant "died": a claim nobody renews): the takeover keeps its claim and runs as soon
    as occurrence 1 ends, instead of being skipped."""
    job_id = f"slot-{uuid.uuid4().hex[:6]}"
    first = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
    second = first + timedelta(seconds=1)
    release = threading.Event()
    runs: list[tuple[datetime, int]] = []

    def job() -> None:
        occurrence = current_occurrence()
        runs.append((occurrence.run_time, occurrence.token))
        if occurrence.run_time == first:
            release.wait(20)

    async def dead_claimant() -> int:
        async with asynclock.connect(spec_sqlite.url) as other:
            ttl = (second - datetime.now(UTC)).total_seconds() + 1.0
            lease = await other.acquire(
                f"{job_id}@{second.isoformat()}", ttl=ttl, token_scope=job_id
            )
            await lease.let_expire()  # nobody renews it: it expires a second after `second`
            return lease.token

    dead_token = anyio.run(dead_claimant)
    executor, scheduler = two_occurrences(spec_sqlite.url, job, job_id, first, second)
    scheduler.start()
    try:
        assert wait_for(lambda: executor.taken_over == 1), "occurrence 2 was not taken over"
        assert [t for t, _ in runs] == [first]  # still running: no slot for the takeover
        release.set()
        assert wait_for(lambda: len(runs) == 2), "the takeover never ran"
    finally:
        release.set()
        scheduler.shutdown()
    assert [t for t, _ in runs] == [first, second]
    assert runs[1][1] > runs[0][1] > dead_token  # the takeover draws a new, larger token
    assert executor.skipped == 0


def test_a_claim_given_up_at_max_instances_is_released(spec_sqlite: BackendSpec) -> None:
    """A job runs longer than its interval (max_instances=1): the next occurrence's claim is
    given up at once, and released. Before: the release was started from the executor's
    own loop thread, which a portal refuses ("cannot be called from the event loop
    thread"): the claim stayed held, and renewed, until shutdown."""
    job_id = f"long-{uuid.uuid4().hex[:6]}"
    first = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
    second = first + timedelta(seconds=1)
    release = threading.Event()
    skipped = threading.Event()

    def job() -> None:
        release.wait(20)

    def on_skipped(event: Any) -> None:
        if event.scheduled_run_times == [second]:
            skipped.set()

    async def claimed(name: str) -> bool:
        async with spec_sqlite.connect() as other:
            return await other.locked(name)

    _, scheduler = two_occurrences(spec_sqlite.url, job, job_id, first, second)
    scheduler.add_listener(on_skipped, EVENT_JOB_MAX_INSTANCES)
    scheduler.start()
    try:
        assert skipped.wait(20), "the second occurrence was not skipped at max_instances"
        name = f"{job_id}@{second.isoformat()}"
        # Past one claim ttl a leaked claim is still there: the executor renews it.
        assert wait_for(lambda: not anyio.run(claimed, name), timeout=5), "claim not released"
    finally:
        release.set()
        scheduler.shutdown()


# -- misconfigurations ----------------------------------------------------------------------


def job_noop() -> None:
    pass


@pytest.mark.parametrize(
    ("trigger", "options", "match"),
    [
        (IntervalTrigger(seconds=5), {}, "interval trigger without a fixed start_date"),
        (CronTrigger(second="*/5", jitter=2), {}, "jitter=2"),
        (CronTrigger(second="*/5"), {"misfire_grace_time": None}, "misfire_grace_time=None"),
        (
            CronTrigger(second="*/5"),
            {"misfire_grace_time": 30},
            r"claim_ttl=10s must exceed misfire_grace_time \(30s\) \+ clock_skew \(1s\)",
        ),
    ],
)
def test_misconfigured_jobs_are_refused_at_start(
    trigger: Any, options: dict[str, Any], match: str
) -> None:
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(ClaimingExecutor("memory://", claim_ttl=10.0), "default")
    scheduler.add_job(job_noop, trigger, id="bad", **options)
    with pytest.raises(ValueError, match=match):
        scheduler.start()
    assert not scheduler.running


def test_a_coroutine_job_under_a_background_scheduler_is_refused() -> None:
    async def job() -> None:
        pass

    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(ClaimingExecutor("memory://", claim_ttl=10.0), "default")
    scheduler.add_job(job, "cron", second="*", id="async-job")
    with pytest.raises(ValueError, match="is a coroutine function, which only an AsyncIOScheduler"):
        scheduler.start()


def test_a_takeover_window_too_short_to_outlast_a_dead_claim_is_refused() -> None:
    scheduler = BackgroundScheduler(timezone="UTC")
    executor = ClaimingExecutor("memory://", claim_ttl=10.0, takeover_window=12.0)
    scheduler.add_executor(executor, "default")
    scheduler.add_job(job_noop, CronTrigger(second="*/5"), id="short", misfire_grace_time=2)
    with pytest.raises(
        ValueError,
        match=r"job 'short': takeover_window=12s must exceed misfire_grace_time \(2s\) \+ "
        r"clock_skew \(1s\) \+ claim_ttl \(10s\) = 13s",
    ):
        scheduler.start()
    job = scheduler.add_job(job_noop, CronTrigger(second="*/5"), id="ok", misfire_grace_time=2)
    check_job(job, claim_ttl=10.0, takeover_window=13.5)
    check_job(job, claim_ttl=10.0)  # the default: grace + skew + 2 x claim_ttl
    with pytest.raises(ValueError, match=r"more than asynclock\.MAX_TTL"):
        check_job(job, claim_ttl=10.0, takeover_window=asynclock.MAX_TTL)


def test_a_pinned_interval_trigger_is_accepted() -> None:
    pinned = IntervalTrigger(seconds=5, start_date=datetime(2026, 1, 1, tzinfo=UTC))
    scheduler = BackgroundScheduler(timezone="UTC")
    job = scheduler.add_job(job_noop, pinned, id="ok", misfire_grace_time=2)
    check_job(job, claim_ttl=10.0)
    with pytest.raises(ValueError, match="interval trigger"):
        check_job(scheduler.add_job(job_noop, "interval", seconds=5, id="x"), claim_ttl=10.0)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("localhost:6379",), {"claim_ttl": 5}, ValueError, "lock URL like"),
        ((42,), {"claim_ttl": 5}, TypeError, "url_or_backend must be"),
        (("memory://",), {"claim_ttl": 0}, ValueError, "claim_ttl must be a finite"),
        (("memory://",), {"claim_ttl": "5"}, TypeError, "claim_ttl must be a number"),
        (("memory://",), {"claim_ttl": 5, "clock_skew": -1}, ValueError, "clock_skew"),
        (("memory://",), {"claim_ttl": 5, "inner": object()}, TypeError, "inner must be"),
        (("memory://",), {"claim_ttl": 5, "takeover_window": "9"}, TypeError, "takeover_window"),
        (("memory://",), {"claim_ttl": 5, "takeover_window": 0}, ValueError, "takeover_window"),
        (
            ("memory://",),
            {"claim_ttl": 5, "inner": ProcessPoolExecutor(1)},
            TypeError,
            "inner must run jobs in this process",
        ),
    ],
)
def test_bad_executor_arguments_are_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ClaimingExecutor(*args, **kwargs)


# -- leader only ----------------------------------------------------------------------------


def test_leader_only_runs_jobs_on_the_leader_and_fails_over(spec_sqlite: BackendSpec) -> None:
    name = f"leader-{uuid.uuid4().hex[:6]}"
    runs: dict[str, int] = {"a": 0, "b": 0}
    ran = {"a": threading.Event(), "b": threading.Event()}

    def make(node: str) -> tuple[BackgroundScheduler, Any]:
        scheduler = BackgroundScheduler(timezone="UTC")

        def tick() -> None:
            runs[node] += 1
            ran[node].set()

        scheduler.add_job(tick, "interval", seconds=0.1, id="tick")
        campaign = leader_only(scheduler, spec_sqlite.url, name, ttl=1.0, identity=node)
        scheduler.add_listener(lambda e: None, EVENT_JOB_EXECUTED)
        return scheduler, campaign

    (sa, ca), (sb, cb) = make("a"), make("b")
    sa.start()
    assert ca.leading.wait(10)
    sb.start()
    try:
        assert ran["a"].wait(10)
        assert not cb.leading.is_set()
        time.sleep(0.5)  # b keeps campaigning meanwhile; it must not run a job
        assert runs["b"] == 0 and not ran["b"].is_set()
        sa.shutdown(wait=False)  # the leader goes: its term is released, b takes over
        assert cb.leading.wait(10)
        assert ran["b"].wait(10)
        assert cb.term is not None and cb.term.identity == "b"
    finally:
        for scheduler in (sa, sb):
            if scheduler.running:
                scheduler.shutdown(wait=False)


def test_a_misconfigured_job_added_after_start_is_refused_when_submitted() -> None:
    refused = threading.Event()
    messages: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and isinstance(record.exc_info[1], ValueError):
                messages.append(str(record.exc_info[1]))
                refused.set()

    handler = Catch()
    logging.getLogger("apscheduler").addHandler(handler)
    ran: list[bool] = []
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(ClaimingExecutor("memory://", claim_ttl=10.0), "default")
    scheduler.start()
    try:
        scheduler.add_job(
            lambda: ran.append(True),
            CronTrigger(second="*", jitter=3),
            id="late-bad",
            next_run_time=datetime.now(UTC),
        )
        assert refused.wait(10)
    finally:
        scheduler.shutdown()
        logging.getLogger("apscheduler").removeHandler(handler)
    assert "job 'late-bad': its trigger has jitter=3" in messages[0]
    assert ran == []


def test_the_integration_exports_what_it_documents() -> None:
    import asynclock_apscheduler

    assert set(asynclock_apscheduler.__all__) == {
        "ClaimingExecutor",
        "LeaderOnly",
        "Occurrence",
        "check_job",
        "current_occurrence",
        "leader_only",
    }
    assert all(hasattr(asynclock_apscheduler, name) for name in asynclock_apscheduler.__all__)


def test_the_integration_imports_only_the_public_api() -> None:
    package = ROOT / "integrations" / "asynclock_apscheduler"
    for source in package.glob("*.py"):
        text = source.read_text()
        assert "asynclock._" not in text and "from asynclock." not in text, source.name
