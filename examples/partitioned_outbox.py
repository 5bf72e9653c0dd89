"""One worker per entity, in order, without a lock per key: an outbox consumed by a fleet.

An outbox table holds events of 40 entities (5 each, numbered 1..5 per entity). Three
workers join the group "outbox" of 8 partitions (``backend.partitions``); each entity's
events live in the partition of its id (the producer routes with
``asynclock.partition_of(entity, 8)``), and each partition is consumed by one worker at a
time, so each entity's events are applied in order. Every write is fenced by the
partition token (``SQLFence``, key ``outbox:<partition>``): the first thing a new owner
does is raise the fence, so a former owner that wakes up late cannot write. Midway one
worker leaves; its partitions move to the others, who carry on from where it stopped.
Run: uv run python examples/partitioned_outbox.py
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import anyio

import asynclock
from asynclock.fence import SQLFence

ENTITIES, EVENTS, COUNT = 40, 5, 8


def connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None, timeout=10)
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


def setup(db: Path, fence: SQLFence) -> None:
    with connect(db) as conn:
        fence.create_sqlite(conn)
        conn.execute(
            "CREATE TABLE outbox (id INTEGER PRIMARY KEY, entity TEXT, seq INTEGER, part INTEGER)"
        )
        conn.execute("CREATE TABLE entity (id TEXT PRIMARY KEY, last_seq INTEGER, log TEXT)")
        conn.execute("BEGIN")
        for seq in range(1, EVENTS + 1):
            for n in range(ENTITIES):
                entity = f"customer:{n}"
                conn.execute(
                    "INSERT INTO outbox (entity, seq, part) VALUES (?, ?, ?)",
                    (entity, seq, asynclock.partition_of(entity, COUNT)),  # the producer routes
                )
        conn.execute("COMMIT")


def apply_next(db: Path, fence: SQLFence, partition: asynclock.Partition) -> bool:
    """Apply the next event of this partition's entities, in one fenced transaction.
    False when none is left."""
    conn = connect(db)
    try:
        with fence.sqlite_transaction(conn, f"outbox:{partition.id}", partition.token):
            row = conn.execute(
                "SELECT o.entity, o.seq FROM outbox o LEFT JOIN entity e ON e.id = o.entity "
                "WHERE o.part = ? AND o.seq = COALESCE(e.last_seq, 0) + 1 ORDER BY o.id LIMIT 1",
                (partition.id,),
            ).fetchone()
            if row is None:
                return False
            entity, seq = row
            conn.execute(
                "INSERT INTO entity (id, last_seq, log) VALUES (?, ?, ?) ON CONFLICT(id) DO "
                "UPDATE SET last_seq = excluded.last_seq, log = log || ',' || excluded.log",
                (entity, seq, str(seq)),
            )
            return True
    finally:
        conn.close()


def raise_fence(db: Path, fence: SQLFence, partition: asynclock.Partition) -> None:
    conn = connect(db)
    try:
        with fence.sqlite_transaction(conn, f"outbox:{partition.id}", partition.token):
            pass  # from now on, writes with an earlier owner's token are refused
    finally:
        conn.close()


async def worker(
    name: str, locks: str, db: Path, fence: SQLFence, stop: anyio.Event, seen: dict[str, int]
) -> None:
    async def consume(partition: asynclock.Partition) -> None:
        # Blocking database calls run in a thread; a hand-over waits for the one running.
        await anyio.to_thread.run_sync(raise_fence, db, fence, partition)
        seen[f"{name}/{partition.id}"] = partition.token
        while True:
            while await anyio.to_thread.run_sync(apply_next, db, fence, partition):
                pass
            await anyio.sleep(0.05)  # poll for new events

    async with (
        asynclock.connect(locks) as backend,
        backend.partitions("outbox", count=COUNT, ttl=1.0) as member,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(member.run, consume)
        await stop.wait()
        tg.cancel_scope.cancel()


def applied(db: Path) -> int:
    with connect(db) as conn:
        return int(conn.execute("SELECT COALESCE(SUM(last_seq), 0) FROM entity").fetchone()[0])


async def until_applied(db: Path, events: int) -> None:
    while True:  # the workers are in this process, but the table is the shared truth
        if applied(db) >= events:
            return
        await anyio.sleep(0.02)


async def main(tmp: Path) -> None:
    db, locks, fence = tmp / "app.db", f"sqlite:///{tmp / 'locks.db'}", SQLFence()
    setup(db, fence)  # the producer routes each entity itself: no group, no connection
    stops = {name: anyio.Event() for name in ("worker-a", "worker-b", "worker-c")}
    seen: dict[str, int] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for name, stop in stops.items():
                tg.start_soon(worker, name, locks, db, fence, stop, seen)
            await until_applied(db, ENTITIES * EVENTS // 3)
            stops["worker-a"].set()  # leaves the group: its partitions move
            print("worker-a left the group midway")
            await until_applied(db, ENTITIES * EVENTS)
            for stop in stops.values():
                stop.set()
    with connect(db) as conn:
        logs = conn.execute("SELECT log FROM entity").fetchall()
    in_order = [log for (log,) in logs] == [",".join(map(str, range(1, EVENTS + 1)))] * ENTITIES
    print(f"applied {applied(db)} events of {ENTITIES} entities, each in order once: {in_order}")
    moved = sorted({k.split("/")[1] for k in seen if k.startswith("worker-a/")})
    taken = [k for k in seen if not k.startswith("worker-a/") and k.split("/")[1] in moved]
    print(f"worker-a's partitions taken over by the others: {bool(taken)}")
    old = next(k for k in seen if k.startswith("worker-a/"))
    conn = connect(db)
    try:
        with fence.sqlite_transaction(conn, f"outbox:{old.split('/')[1]}", seen[old]):
            pass
    except asynclock.StaleToken:
        print("a write with worker-a's old partition token is refused: StaleToken")
    finally:
        conn.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
