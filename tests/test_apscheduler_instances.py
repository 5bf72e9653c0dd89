"""asynclock_apscheduler: ``fleet_max_instances=True`` (issue 42 item 5): a job's
``max_instances`` holds across scheduler processes, and a killed node's permit comes
back within its ttl (apscheduler#1110's case)."""

from __future__ import annotations

import itertools
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynclock._harness import WorkerGroup
from asynclock_apscheduler import ClaimingExecutor
from tests.support.spec import BackendSpec
from tests.test_apscheduler import Events, drain_and_stop, node_config, start_node

pytestmark = pytest.mark.anyio


def runs(events: Events) -> list[tuple[float, float, str, int]]:
    """(start, end, run time, node) of every finished run, by wall clock (one machine)."""
    began = {(i, e["run_time"]): e["at"] for i, e in events.seen if e["event"] == "job_started"}
    return sorted(
        (began[(i, e["run_time"])], e["at"], e["run_time"], i)
        for i, e in events.seen
        if e["event"] == "ran" and (i, e["run_time"]) in began
    )


def overlaps(spans: list[tuple[float, float, str, int]]) -> list[Any]:
    return [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["background", "asyncio"])
async def test_max_instances_1_holds_across_two_schedulers(
    spec_sqlite: BackendSpec, tmp_path: Path, kind: str
) -> None:
    """Two nodes, an every-second job that runs 2.5 s with max_instances=1: never two
    runs at once anywhere; the occurrences that found the one permit held are skipped
    (EVENT_JOB_MAX_INSTANCES), each on one node only."""
    config = node_config(tmp_path, kind=kind, work=2.5, fleet_max_instances=True)
    events = Events()
    with anyio.fail_after(90):
        async with WorkerGroup() as group:
            async with anyio.create_task_group() as tg:
                nodes = [await start_node(spec_sqlite, group, **config) for _ in range(2)]
                for i, node in enumerate(nodes):
                    await node.expect("started")
                    tg.start_soon(events.pump, i, node)
                await events.until(lambda: len(events.of("ran")) >= 3)
                for node in nodes:
                    await node.send("pause")
                await events.until(lambda: len(events.of("paused")) == 2)
                await drain_and_stop(events, nodes)
            for node in nodes:
                await node.wait()
    spans = runs(events)
    assert len(spans) >= 3
    assert not overlaps(spans), spans
    assert not events.of("job_error"), events.of("job_error")
    skipped = [t for e in events.of("max_instances") for t in e["run_times"]]
    assert skipped, "no occurrence met the held permit"
    assert len(skipped) == len(set(skipped)), skipped  # marked done: one node skips it
    started = [e["run_time"] for e in events.of("job_started")]
    assert not set(skipped) & set(started)


@pytest.mark.timeout(120)
async def test_a_killed_nodes_permit_comes_back_within_its_ttl(
    spec_redis: BackendSpec, tmp_path: Path
) -> None:
    """apscheduler#1110: a node is killed (SIGKILL) mid-run holding the job's only
    instance permit; the other node runs the job again within the claim ttl (5 s) plus a
    second of schedule, never "maximum number of running instances reached" for ever."""
    config = node_config(tmp_path, kind="background", work=1.5, fleet_max_instances=True)
    events = Events()
    with anyio.fail_after(90):
        async with WorkerGroup() as group:
            async with anyio.create_task_group() as tg:
                nodes = [await start_node(spec_redis, group, **config) for _ in range(2)]
                for i, node in enumerate(nodes):
                    await node.expect("started")
                    tg.start_soon(events.pump, i, node)
                await events.until(lambda: bool(events.of("job_started")))
                (victim, first), *_ = [
                    (i, e) for i, e in events.seen if e["event"] == "job_started"
                ]
                nodes[victim].signal(signal.SIGKILL)
                survivor = 1 - victim
                killed_at = first["at"]
                await events.until(
                    lambda: any(e["at"] > killed_at for e in events.of("job_started", survivor))
                )
                await nodes[survivor].send("pause")
                await events.until(lambda: bool(events.of("paused", survivor)))
                await drain_and_stop(events, [nodes[survivor]])
            for node in nodes:
                await node.wait()
    after = [e for e in events.of("job_started", survivor) if e["at"] > killed_at]
    assert after[0]["at"] - killed_at < config["claim_ttl"] + 2.0, (killed_at, after)
    assert datetime.fromisoformat(after[0]["run_time"]) >= datetime.fromisoformat(first["run_time"])


def test_fleet_max_instances_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="fleet_max_instances"):
        ClaimingExecutor("memory://", claim_ttl=5, fleet_max_instances=1)  # type: ignore[arg-type]
