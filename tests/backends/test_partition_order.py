"""Partitions (issue 43): each key's events applied exactly once and in order, across
rebalances. 10,000 keys, 3 events each, appended to a source table in three rounds while
the members consume; three members start, one leaves after the first round, a new one
joins after the second. Each member has its own connection to the lock server (SQLite);
each partition's consume applies its events in fenced transactions (``SQLFence``, key
``part:<id>``, the partition token) that also advance the partition's offset, so a
consume that took over resumes where the last owner committed."""

from __future__ import annotations

import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest

import asynclock
from asynclock.fence import SQLFence
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

KEYS, EVENTS, COUNT, TTL, HEARTBEAT, BATCH = 10_000, 3, 32, 1.5, 1 / 3, 500
FENCE = SQLFence()


def connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None, timeout=20)
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def create(db: Path) -> None:
    with connect(db) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        FENCE.create_sqlite(conn)
        conn.execute("CREATE TABLE source (id INTEGER PRIMARY KEY, key TEXT, seq INT, part INT)")
        conn.execute("CREATE INDEX source_part ON source (part, id)")
        conn.execute("CREATE TABLE target (key TEXT PRIMARY KEY, last_seq INT, applied INT)")
        conn.execute("CREATE TABLE offsets (part INT PRIMARY KEY, last_id INT)")
        conn.execute("CREATE TABLE violations (key TEXT, seq INT, found INT)")


def produce(db: Path, seq: int) -> None:
    """Round ``seq``: event ``seq`` of every key, in a shuffled key order, routed by
    ``asynclock.partition_of`` (the producer joins no group)."""
    keys = [f"entity:{n}" for n in range(KEYS)]
    random.shuffle(keys)
    with connect(db) as conn:
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO source (key, seq, part) VALUES (?, ?, ?)",
            [(key, seq, asynclock.partition_of(key, COUNT)) for key in keys],
        )
        conn.execute("COMMIT")


def apply_batch(db: Path, part: int, token: int) -> int:
    """The partition's next events after its offset, applied and the offset advanced in
    one fenced transaction (StaleToken: nothing written). How many were applied."""
    conn = connect(db)
    try:
        with FENCE.sqlite_transaction(conn, f"part:{part}", token):
            row = conn.execute("SELECT last_id FROM offsets WHERE part = ?", (part,)).fetchone()
            offset = 0 if row is None else row[0]
            events = conn.execute(
                "SELECT id, key, seq FROM source WHERE part = ? AND id > ? ORDER BY id LIMIT ?",
                (part, offset, BATCH),
            ).fetchall()
            for _, key, seq in events:
                found = conn.execute("SELECT last_seq FROM target WHERE key = ?", (key,)).fetchone()
                last = 0 if found is None else found[0]
                if last != seq - 1:  # a duplicate or a gap: not exactly once, in order
                    conn.execute("INSERT INTO violations VALUES (?, ?, ?)", (key, seq, last))
                conn.execute(
                    "INSERT INTO target (key, last_seq, applied) VALUES (?, ?, 1) ON CONFLICT "
                    "(key) DO UPDATE SET last_seq = excluded.last_seq, applied = applied + 1",
                    (key, seq),
                )
            if events:
                conn.execute(
                    "INSERT INTO offsets VALUES (?, ?) ON CONFLICT (part) DO UPDATE "
                    "SET last_id = excluded.last_id",
                    (part, events[-1][0]),
                )
            return len(events)
    finally:
        conn.close()


class Fleet:
    def __init__(self, spec: BackendSpec, group: str, db: Path, tg: anyio.abc.TaskGroup) -> None:
        self.spec, self.group, self.db, self.tg = spec, group, db, tg
        self.refused = 0
        self.grants: list[tuple[int, int]] = []  # (partition, token) per consume started

    def applied(self) -> int:
        """Events applied, as committed (a batch committed just before its consume was
        cancelled counts: the table is the truth, not the consumes' own counts)."""
        with connect(self.db) as conn:
            return int(conn.execute("SELECT COALESCE(SUM(applied), 0) FROM target").fetchone()[0])

    async def until_applied(self, n: int, timeout: float = 30) -> None:
        with anyio.fail_after(timeout):
            while True:  # the table is in another thread's hands: polled
                if await anyio.to_thread.run_sync(self.applied) >= n:
                    return
                await anyio.sleep(0.05)

    async def consume(self, partition: asynclock.Partition) -> None:
        part, token = partition.id, partition.token
        self.grants.append((part, token))
        while True:
            try:
                done = await anyio.to_thread.run_sync(apply_batch, self.db, part, token)
            except asynclock.StaleToken:
                self.refused += 1
                await partition.lost  # a newer owner: its loss (and cancel) is on its way
                raise
            if done < BATCH:
                await anyio.sleep(0.02)  # poll for new events

    async def member(self) -> Callable[[], Awaitable[None]]:
        """Start a member (its own connection); returns a coroutine function that makes it
        leave the group and returns once it has."""
        stop, left, joined = anyio.Event(), anyio.Event(), anyio.Event()

        async def run() -> None:
            async with (
                self.spec.connect(heartbeat=HEARTBEAT) as backend,
                backend.partitions(self.group, count=COUNT, ttl=TTL) as member,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(member.run, self.consume)
                joined.set()
                await stop.wait()
                tg.cancel_scope.cancel()
            left.set()

        async def leave() -> None:
            stop.set()
            with anyio.fail_after(20):
                await left.wait()

        self.tg.start_soon(run)
        with anyio.fail_after(20):
            await joined.wait()
        return leave


@pytest.mark.parametrize("spec", ["sqlite"], indirect=True)
async def test_each_key_in_order_exactly_once_across_rebalances(
    spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    db = tmp_path / "app.db"
    create(db)
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        fleet = Fleet(spec, lock_name, db, tg)
        leaves = [await fleet.member() for _ in range(3)]
        await anyio.to_thread.run_sync(produce, db, 1)
        await fleet.until_applied(KEYS // 2)
        await leaves.pop(0)()  # one leaves midway through round 1: its partitions move
        await anyio.to_thread.run_sync(produce, db, 2)
        await fleet.until_applied(KEYS + KEYS // 2)
        leaves.append(await fleet.member())  # one joins midway through round 2
        await anyio.to_thread.run_sync(produce, db, 3)
        await fleet.until_applied(KEYS * EVENTS)
        for leave in leaves:
            await leave()
    took = time.monotonic() - started
    with connect(db) as conn:
        violations = conn.execute("SELECT * FROM violations LIMIT 5").fetchall()
        wrong = conn.execute(
            "SELECT COUNT(*) FROM target WHERE last_seq != ? OR applied != ?", (EVENTS, EVENTS)
        ).fetchone()[0]
        keys = conn.execute("SELECT COUNT(*) FROM target").fetchone()[0]
    moved = len(fleet.grants) - len({part for part, _ in fleet.grants})
    print(
        f"\n{KEYS * EVENTS} events of {KEYS} keys over {COUNT} partitions in {took:.1f}s: "
        f"{len(fleet.grants)} consumes ({moved} after a move), {fleet.refused} stale batches "
        f"refused, violations {len(violations)}"
    )
    assert violations == []
    assert keys == KEYS and wrong == 0
    assert fleet.applied() == KEYS * EVENTS
    assert moved > 0  # the leave and the join moved partitions mid-stream
    for part in range(COUNT):  # each partition's owners, in grant order, had rising tokens
        tokens = [token for p, token in fleet.grants if p == part]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (part, tokens)
