"""Partitions across processes (issue 43): a member in another process is SIGKILLed; its
partitions are free within its ttl and the member left takes them all within ttl + one
renewal interval (plus the round trips). A member SIGSTOPped past its ttl: the other
takes its partitions as fast, and raises their fences; on SIGCONT the frozen member's
consumes are cancelled and every write it tries with its old tokens is refused."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynclock._harness import Worker, WorkerGroup
from asynclock.fence import SQLFence
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

COUNT, TTL, HEARTBEAT = 64, 1.5, 1 / 3


@pytest.fixture(params=["sqlite", "redis"])
def proc_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


async def test_sigkill_frees_within_ttl(proc_spec: BackendSpec, lock_name: str) -> None:
    spec = proc_spec
    cfg = {
        "url": spec.url,
        "options": spec.options,
        "group": lock_name,
        "count": COUNT,
        "ttl": TTL,
        "parent": os.getpid(),
    }
    async with spec.connect(heartbeat=HEARTBEAT) as backend:
        async with backend.partitions(lock_name, count=COUNT, ttl=TTL) as member:
            process = await anyio.open_process(
                [sys.executable, "-m", "tests.support.partition_worker", json.dumps(cfg)]
            )
            try:
                assert process.stdout is not None
                lines = process.stdout
                buffer = b""
                with anyio.fail_after(20):  # the child takes half
                    while True:
                        buffer += await lines.receive()
                        *done, buffer = buffer.split(b"\n")
                        if any(len(json.loads(line)["owned"]) == COUNT // 2 for line in done):
                            break
                changes = member.changes()
                with anyio.fail_after(10):
                    while len(await changes.__anext__()) != COUNT // 2:
                        pass
                process.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                with anyio.fail_after(TTL + TTL * HEARTBEAT + 3):
                    while len(await changes.__anext__()) != COUNT:
                        pass
                took = time.monotonic() - killed
                print(
                    f"\n{spec.id}: SIGKILLed member's {COUNT // 2} partitions taken in {took:.2f}s"
                )
                assert took <= TTL + TTL * HEARTBEAT + 1
                assert [o.member for o in await member.holders()] == [member.id] * COUNT
            finally:
                if process.returncode is None:
                    process.kill()
                await process.wait()


@dataclass
class Seen:
    """What one member process reported (``tests.support.partition_worker`` lines)."""

    owned: set[int] = field(default_factory=set)
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind and e["t"] >= since]


async def follow(worker: Worker, seen: Seen, changed: list[anyio.Event]) -> None:
    while True:
        for event in await worker.next_events(timeout=120, what="a report"):
            if "owned" in event:
                seen.owned = set(event["owned"])
            else:
                seen.events.append(event)
        changed[0].set()
        changed[0] = anyio.Event()


async def until(changed: list[anyio.Event], done: Callable[[], bool], timeout: float) -> float:
    """Wait (at most ``timeout`` s) until ``done()``, re-checked at every report; the time."""
    with anyio.fail_after(timeout):
        while not done():
            await changed[0].wait()
    return time.monotonic()


async def test_sigstop_moves_partitions_and_fences_the_frozen_member(
    proc_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    spec, count = proc_spec, 16
    db = tmp_path / "fenced.db"
    with sqlite3.connect(db, isolation_level=None) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        SQLFence().create_sqlite(conn)
        conn.execute("CREATE TABLE writes (id INTEGER PRIMARY KEY, part INT, token INT, pid INT)")
    cfg = {
        "url": spec.url,
        "options": {**spec.options, "heartbeat": HEARTBEAT},
        "group": lock_name,
        "count": count,
        "ttl": TTL,
        "parent": os.getpid(),
        "db": str(db),
        "every": 0.1,
    }
    argv = ["-m", "tests.support.partition_worker", json.dumps(cfg)]
    changed = [anyio.Event()]
    a, b = Seen(), Seen()
    async with WorkerGroup() as group, anyio.create_task_group() as tg:
        frozen = await group.start(argv, label="member a", stderr=tmp_path / "a.err")
        other = await group.start(argv, label="member b", stderr=tmp_path / "b.err")
        tg.start_soon(follow, frozen, a, changed)
        tg.start_soon(follow, other, b, changed)

        def fenced(seen: Seen, parts: set[int], since: float = 0.0) -> bool:
            return parts <= {e["partition"] for e in seen.of("fenced", since)}

        await until(
            changed,
            lambda: (
                len(a.owned) == len(b.owned) == count // 2
                and fenced(a, a.owned)
                and fenced(b, b.owned)
            ),
            30,
        )
        taken = set(a.owned)
        await frozen.send("stop")  # it SIGSTOPs itself, holding no SQLite write lock
        await frozen.wait_stopped(10)
        stopped = time.monotonic()
        bound = TTL + TTL * HEARTBEAT
        moved = await until(changed, lambda: len(b.owned) == count, bound + 5)
        await until(changed, lambda: fenced(b, taken, stopped), 10)
        took = moved - stopped
        # Read before the SIGCONT: the resumed member may report its cancelled consumes
        # before this process runs again (a CI run saw 0 of 8 "cancelled" events: they came
        # a hair before a `resumed` read after the signal, and were filtered out).
        resumed = time.monotonic()
        frozen.resume()
        await until(
            changed,
            lambda: {e["partition"] for e in a.of("late_write", resumed)} >= taken,
            20,
        )
        tg.cancel_scope.cancel()
    cancelled = {e["partition"]: e for e in a.of("cancelled", resumed)}
    late = a.of("late_write", resumed)
    refused = a.of("refused", resumed)
    reasons = sorted({c["reason"] for c in cancelled.values()})
    print(
        f"\n{spec.id}: SIGSTOPped member's {len(taken)} partitions taken in {took:.2f}s; on "
        f"SIGCONT {len(cancelled)} consumes cancelled ({reasons}), "
        f"{len(refused)} writes refused in the loop, {len(late)} late writes: "
        f"{sum(e['accepted'] for e in late)} accepted"
    )
    assert took <= bound + 1
    assert set(cancelled) >= taken
    assert all(cancelled[p]["reason"] for p in taken)
    assert not any(e["accepted"] for e in late if e["partition"] in taken)
    # The table: per partition, tokens never go down (no write of an older owner landed
    # after a newer owner's, in the loop or late), and the new owner's fence is above the
    # frozen member's.
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT part, token, pid FROM writes ORDER BY id").fetchall()
    high: dict[int, int] = {}
    for part, token, _ in rows:
        assert token >= high.get(part, 0), (part, token, high[part])
        high[part] = token
    for part in taken:
        assert high[part] > max(e["token"] for e in a.of("fenced") if e["partition"] == part)
