"""The drill's faults for Redis as people deploy it (issue 41): ``failover`` on Sentinel
with and without WAIT, and ``restart`` (a lock server back without its data)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import asynclock.drill

SHORT: dict[str, Any] = {"workers": 3, "duration": 3.0, "ttl": 0.5, "seed": 5}


@pytest.mark.timeout(120)
def test_failover_without_wait_shows_the_double_grant_and_the_fence_holds(
    drill_replays: list[tuple[Any, list[str]]],
) -> None:
    """--no-wait: the holder cut off from the sentinels keeps granting on the old primary
    (writable ~10 s after the failover) while the others use the new one: double grants,
    shown in the report; every stale access is rejected and no update is lost."""
    report = asynclock.drill.run(spawn="redis-sentinel", faults=("failover",), wait=False, **SHORT)
    summary = json.dumps(report.to_json(), indent=1)
    assert [f.kind for f in report.faults] == ["failover"], summary
    assert report.double_grants >= 1, summary
    assert report.counters()["double grants in a failover"] == report.double_grants
    assert report.lost_updates == 0, summary
    assert report.rejected + report.read_rejections >= 1, summary
    assert not report.ok  # two holders at once: the tokens of the split brain interleave
    assert any("tokens did not increase" in p for p in report.problems), summary
    # The replay against the models' invariants sees it too, and no stale write landed.
    [(_, problems)] = drill_replays
    assert any(p.startswith(("G1:", "G2:")) for p in problems), problems
    assert not any(p.startswith("G3:") for p in problems), problems


@pytest.mark.timeout(120)
def test_failover_with_wait_grants_once() -> None:
    """The same fault with wait_replicas=1 (the default of --spawn redis-sentinel): the
    cut-off holder's grants and renewals on the old primary are not confirmed by any
    replica, so nothing is granted twice; nothing is lost."""
    report = asynclock.drill.run(spawn="redis-sentinel", faults=("failover", "pause"), **SHORT)
    summary = json.dumps(report.to_json(), indent=1)
    assert report.double_grants == 0, summary
    assert report.ok and report.problems == [], summary
    assert {f.kind for f in report.faults} == {"failover", "pause"}, summary


@pytest.mark.timeout(120)
def test_restart_without_data_waits_the_grace_and_loses_nothing() -> None:
    """redis with AOF: the restart fault deletes it first, so the server comes back empty
    (tokens reseeded from TIME, no grant for the restart grace): nothing is lost."""
    report = asynclock.drill.run(spawn="redis", faults=("restart", "pause"), **SHORT)
    summary = json.dumps(report.to_json(), indent=1)
    assert report.ok, summary
    restarts = [f for f in report.faults if f.kind == "restart"]
    assert restarts and "without its data" in restarts[0].detail, summary
    assert report.counters()["lock server kills"] == len(restarts)


def test_faults_that_do_not_apply_are_skipped_with_the_reason() -> None:
    report = asynclock.drill.run(spawn="sqlite", faults=("failover", "restart"), **SHORT)
    assert report.ok
    assert any(s.startswith("failover: only --spawn redis-sentinel") for s in report.skipped)
    assert any(s.startswith("restart: only a lock server") for s in report.skipped)
