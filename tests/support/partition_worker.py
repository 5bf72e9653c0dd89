"""A partition member in its own process, for tests/backends/test_partition_processes.py.

``python -m tests.support.partition_worker CONFIG_JSON`` (``url``, ``options``, ``group``,
``count``, ``ttl``, ``parent``): joins the group and prints one JSON line per assignment
change, ``{"owned": [ids]}`` (no ``"event"`` key), until killed.

With ``db`` (an SQLite file with an ``SQLFence`` table and ``writes(part, token, pid)``)
it also consumes: each partition's consume raises the fence ``part:<id>`` with the
partition token, then appends a fenced row to ``writes`` every ``every`` seconds. It
reports (``asynclock._harness.emit``) ``fenced`` once the fence is raised, ``refused``
for a write refused with StaleToken, and ``cancelled`` when a consume is cancelled; a
cancelled consume then tries one last write with its token, as a write in flight when
the process froze would (``late_write``, with ``accepted``). A line ``stop`` on stdin
makes it SIGSTOP itself where it holds no SQLite write lock (no fenced write open: they
wait at a gate; the sqlite backend's statements run on the event loop, which is here), so
a frozen member never blocks the other's writes (docs/backends/sqlite.md, Limits); the
test sends SIGCONT.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import threading

import anyio

import asynclock
from asynclock._harness import die_with_parent, emit
from asynclock.fence import SQLFence

FENCE = SQLFence()
#: Held by every fenced write, and by ``stop`` from before it stops until it resumes.
GATE = threading.Lock()


def write(db: str, partition: int, token: int) -> bool:
    """One fenced row for ``partition``; False when the fence refused ``token``."""
    with GATE:
        return _write(db, partition, token)


def _write(db: str, partition: int, token: int) -> bool:
    conn = sqlite3.connect(db, isolation_level=None, timeout=20)
    try:
        with FENCE.sqlite_transaction(conn, f"part:{partition}", token):
            conn.execute(
                "INSERT INTO writes (part, token, pid) VALUES (?, ?, ?)",
                (partition, token, os.getpid()),
            )
        return True
    except asynclock.StaleToken:
        return False
    finally:
        conn.close()


def consumer(db: str, every: float):  # type: ignore[no-untyped-def]
    async def consume(partition: asynclock.Partition) -> None:
        number, token = partition.id, partition.token
        try:
            first = True
            while True:
                if await anyio.to_thread.run_sync(write, db, number, token):
                    if first:
                        emit("fenced", partition=number, token=token)
                        first = False
                else:
                    emit("refused", partition=number, token=token)
                    await partition.lost  # gone: its cancel comes with the loss
                await anyio.sleep(every)
        except anyio.get_cancelled_exc_class():
            reason = partition.lost.reason if partition.lost else None
            emit("cancelled", partition=number, token=token, reason=reason)
            with anyio.CancelScope(shield=True):
                accepted = await anyio.to_thread.run_sync(write, db, number, token)
            emit("late_write", partition=number, token=token, accepted=accepted)
            raise

    return consume


async def stop_on_request() -> None:
    while await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
        await anyio.to_thread.run_sync(GATE.acquire)
        try:
            os.kill(os.getpid(), signal.SIGSTOP)  # from the loop: no SQL statement open
        finally:
            GATE.release()


async def main(cfg: dict[str, object]) -> None:
    async with (
        asynclock.connect(str(cfg["url"]), **cfg["options"]) as backend,  # type: ignore[arg-type]
        backend.partitions(str(cfg["group"]), count=cfg["count"], ttl=cfg["ttl"]) as member,  # type: ignore[arg-type]
        anyio.create_task_group() as tg,
    ):
        if "db" in cfg:
            tg.start_soon(member.run, consumer(str(cfg["db"]), float(cfg["every"])))  # type: ignore[arg-type]
            tg.start_soon(stop_on_request)
        async for owned in member.changes():
            print(json.dumps({"owned": sorted(owned)}), flush=True)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    die_with_parent(int(config["parent"]))
    anyio.run(main, config)
