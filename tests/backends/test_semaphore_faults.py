"""Counting semaphores under faults, with real processes (issue 42, "Tests").

Worker processes (tests/support/semaphore_worker.py, through asynclock's process harness)
loop over permits of one semaphore and, while holding one, write ``enter`` and ``exit`` to
a fenced probe resource of the permit's slot ("token > last" to enter, "token == last" to
exit, atomically in the store under test). The parent SIGSTOPs holders past their ttl
(resumed only once their slot was granted again: an event, not a guess), SIGSTOPs random
workers for random lengths (the scenario's pauses), and SIGKILLs a holder.

Checked: the probe's own log has strictly increasing tokens per slot and never accepts a
stale holder's write; only a holder past its local deadline is ever refused; the bodies the
probe accepted never overlap on one slot and never number more than ``limit`` at once; a
frozen holder's late write is refused; a SIGKILLed holder's permit comes back within its
ttl (plus a margin for a loaded machine), also with limit 1 (apscheduler#1110's shape).

Scaled down from the issue's 16 holders and 10,000 acquisitions: 8 workers and about
``ACQUISITIONS`` acquisitions per backend, so that each backend's run stays under ~20 s on
a loaded 2-core machine shared with the servers (16 processes there mostly measure the
scheduler; the faults and checks are the same). The issue's scale runs with
``ASYNCLOCK_SEM_STRESS=16,10000`` (workers, acquisitions). The figures are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynclock._harness import Hold, Worker, WorkerGroup, overlaps, tokens_out_of_order
from tests.support.semaphore_worker import Probe
from tests.support.spec import BackendSpec

BACKEND_IDS = ["sqlite", "redis", "postgres"]
_SCALE = os.environ.get("ASYNCLOCK_SEM_STRESS", "8,800").split(",")
WORKERS = int(_SCALE[0])
LIMIT = 3
TTL = 1.0
#: Acquisitions in all (every worker's, faults included) before the run stops: the faults
#: take about 500 of them; the rest is the same loop without faults (4,000, then 2,000,
#: then 1,200, until the suite's time budget asked for time back; the issue's scale is run
#: by hand).
ACQUISITIONS = int(_SCALE[1])

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(max(150, ACQUISITIONS // 10))]
#: Bound on any one wait for an event.
WAIT = 20.0
#: Allowed beyond the ttl for a killed holder's permit to be granted again: the waiters'
#: poll (at most ttl / 10) and a loaded machine's scheduling.
MARGIN = 1.0


class Events:
    """Every worker's events on one list, and waits for one that matches (bounded)."""

    def __init__(self) -> None:
        self.all: list[dict[str, Any]] = []
        self.counts: dict[str, int] = defaultdict(int)
        self._changed = anyio.Event()

    async def read(self, worker: Worker, label: str) -> None:
        while worker.returncode is None:
            try:
                batch = await worker.next_events(timeout=3600)
            except Exception:
                return
            for event in batch:
                event["worker"] = label
                self.counts[event["event"]] += 1
            self.all += batch
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_for(
        self, what: str, match: Callable[[dict[str, Any]], bool], since: int = 0
    ) -> dict[str, Any]:
        with anyio.move_on_after(WAIT):
            while True:
                for event in self.all[since:]:
                    if event["event"] == "error":
                        raise AssertionError(f"a worker failed: {event}")
                    if match(event):
                        return event
                since = max(since, len(self.all))
                await self._changed.wait()
        last = {e["worker"]: e for e in self.all}
        raise AssertionError(f"no {what} within {WAIT}s; each worker's last event: {last}")

    def count(self, kind: str) -> int:
        return self.counts[kind]


def event_of(kind: str, i: int) -> Callable[[dict[str, Any]], bool]:
    """Matches worker ``w<i>``'s events of ``kind``."""
    return lambda e: bool(e["event"] == kind and e["worker"] == f"w{i}")


@asynccontextmanager
async def holders(
    spec: BackendSpec, probe: str, name: str, n: int, limit: int, tmp_path: Path
) -> AsyncIterator[tuple[list[Worker], Events]]:
    events = Events()
    async with WorkerGroup() as group, anyio.create_task_group() as tg:
        workers = []
        for i in range(n):
            cfg = {
                "url": spec.url,
                "options": spec.options,
                "probe": probe,
                "name": name,
                "limit": limit,
                "ttl": TTL,
                "work": 0.005,
                "worker": f"w{i}",
                "parent": os.getpid(),
            }
            worker = await group.start(
                ["-m", "tests.support.semaphore_worker", json.dumps(cfg)],
                label=f"semaphore worker w{i}",
                stderr=tmp_path / f"w{i}.err",
            )
            workers.append(worker)
            tg.start_soon(events.read, worker, f"w{i}")
        for i in range(n):
            await events.wait_for("ready", event_of("ready", i))
        yield workers, events
        tg.cancel_scope.cancel()


async def probe_for(spec: BackendSpec, name: str, tmp_path: Path, limit: int) -> Probe:
    store = {"sqlite": str(tmp_path / "probe.db"), "redis": spec.url}.get(spec.id)
    probe = Probe(store or spec.url.split("?")[0], name)
    await probe.open()
    await probe.setup(limit)
    return probe


async def granted_again(events: Events, slot: int, token: int, since: int) -> dict[str, Any]:
    """The next holder of ``slot`` whose ``enter`` the probe accepted (so the fence moved)."""
    return await events.wait_for(
        f"slot {slot} granted again above token {token}",
        lambda e: (
            e["event"] == "enter" and e["slot"] == slot and e["token"] > token and e["accepted"]
        ),
        since,
    )


@pytest.fixture(params=BACKEND_IDS)
def fault_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


async def test_stress_with_stops_and_a_kill(
    fault_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    spec, rng = fault_spec, random.Random(42)
    probe = await probe_for(spec, lock_name, tmp_path, LIMIT)
    began = time.monotonic()
    frozen_results: list[dict[str, Any]] = []
    kill_delay = 0.0
    async with holders(spec, probe.store, lock_name, WORKERS, LIMIT, tmp_path) as (workers, events):
        alive = dict(enumerate(workers))

        def reached(target: int) -> Callable[[dict[str, Any]], bool]:
            return lambda e: events.count("acquired") >= target

        async def run_for(acquisitions: int) -> None:
            # Bounded per 100 acquisitions (progress), not for the whole run: the issue's
            # 10,000 take minutes.
            end = events.count("acquired") + acquisitions
            while (done := events.count("acquired")) < end:
                await events.wait_for(
                    f"{min(end, done + 100)} acquisitions", reached(min(end, done + 100))
                )

        # 1. Holders frozen past their ttl inside the body, resumed once their slot is taken.
        for _ in range(3):
            await run_for(50)
            i = rng.choice(list(alive))
            since = len(events.all)
            await alive[i].send("freeze")
            me = await events.wait_for(
                "freeze_me",
                event_of("freeze_me", i),
                since,
            )
            alive[i].pause()
            await alive[i].wait_stopped(5)
            await granted_again(events, me["slot"], me["token"], since)
            alive[i].resume()
            late = await events.wait_for(
                "late write",
                event_of("late_write", i),
                since,
            )
            frozen_results.append(late)
        # 2. Random workers stopped at random moments (holders when some worker's last
        # event says it holds), for random lengths around the ttl.
        for _ in range(6):
            await run_for(50)
            last = {e["worker"]: e["event"] for e in events.all[-64:]}
            holding = [i for i in alive if last.get(f"w{i}") in ("acquired", "enter")]
            i = rng.choice(holding or list(alive))
            alive[i].pause()
            await anyio.sleep(rng.uniform(0.3, 2.0) * TTL)  # the pause is the scenario
            alive[i].resume()
        # 3. A holder SIGKILLed while holding: its permit is back within its ttl.
        await run_for(50)
        i = rng.choice(list(alive))
        since = len(events.all)
        await alive[i].send("park")
        parked = await events.wait_for("parked", event_of("parked", i), since)
        alive.pop(i).kill()
        killed_at = time.monotonic()
        again = await granted_again(events, parked["slot"], parked["token"], since)
        regranted = next(
            e
            for e in events.all[since:]
            if e["event"] == "acquired"
            and e["slot"] == parked["slot"]
            and e["token"] == again["token"]
        )
        kill_delay = regranted["t"] - killed_at
        # 4. The rest of the run, then stop.
        await run_for(max(0, ACQUISITIONS - events.count("acquired")))
        for worker in alive.values():
            await worker.send("stop")
        for i in alive:
            await events.wait_for("done", event_of("done", i))
        log = await probe.log()
    await probe.aclose()
    elapsed = time.monotonic() - began
    all_events = events.all

    # The probe's own log: per slot, entering tokens strictly increase, and every exit is by
    # the newest holder of its slot (a stale token is never accepted).
    newest: dict[int, int] = {}
    for slot, kind, token, who in log:
        assert 0 <= slot < LIMIT
        if kind == "enter":
            assert token > newest.get(slot, 0), f"slot {slot}: {who} entered with {token}"
            newest[slot] = token
        else:
            assert token == newest.get(slot), f"slot {slot}: stale exit {token} by {who}"
    # Only a holder already past its local deadline is ever refused.
    refused = [e for e in all_events if e["event"] in ("enter", "exit") and not e["accepted"]]
    assert all(e["stale"] for e in refused), [e for e in refused if not e["stale"]]
    # Frozen holders: lost, and their late write refused (their slot had a newer holder).
    assert [e["accepted"] for e in frozen_results] == [False] * len(frozen_results)
    # Bodies the probe accepted: none overlap on a slot, never more than LIMIT at once.
    bodies = [
        Hold(e["worker"], e["start"], e["end"], e["token"], f"slot{e['slot']}")
        for e in all_events
        if e["event"] == "exit" and e["accepted"]
    ]
    assert overlaps(bodies) == []
    assert tokens_out_of_order(bodies) == []
    edges = sorted([(h.start, 1) for h in bodies] + [(h.end, -1) for h in bodies])
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    assert most <= LIMIT
    assert kill_delay <= TTL + MARGIN, f"killed holder's permit back after {kill_delay:.3f}s"
    late_refused = sum(1 for e in all_events if e["event"] == "late_write" and not e["accepted"])
    print(
        f"\n{spec.id}: {events.count('acquired')} acquisitions by {WORKERS} workers in "
        f"{elapsed:.1f}s; bodies accepted {len(bodies)}, at most {most} at once; refused "
        f"writes {len(refused)} + late writes {late_refused}; permits lost "
        f"{events.count('lost')}; killed holder's slot back after {kill_delay:.3f}s (ttl {TTL}s)"
    )


async def test_killed_holder_with_limit_one_is_back_within_ttl(
    fault_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    """apscheduler#1110: a node killed with kill -9 while running the one allowed job; the
    other node gets the permit within the ttl, not "maximum number of 1 jobs" for ever."""
    spec = fault_spec
    probe = await probe_for(spec, lock_name, tmp_path, 1)
    async with holders(spec, probe.store, lock_name, 2, 1, tmp_path) as (workers, events):
        since = len(events.all)
        for worker in workers:
            await worker.send("park")
        parked = await events.wait_for("parked", lambda e: e["event"] == "parked", since)
        holder = int(parked["worker"][1:])
        workers[holder].kill()
        killed_at = time.monotonic()
        again = await granted_again(events, 0, parked["token"], since)
        assert again["worker"] != parked["worker"]
        waited = again["t"] - killed_at
        await probe.aclose()
    assert waited <= TTL + MARGIN, f"the permit came back after {waited:.3f}s"
    print(f"\n{spec.id}: limit 1, holder SIGKILLed: permit back after {waited:.3f}s (ttl {TTL}s)")
