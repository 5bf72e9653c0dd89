"""Three APScheduler processes, one schedule: each occurrence runs once, fenced.

Every node runs the same BackgroundScheduler with the same job (every second) and a
ClaimingExecutor on one SQLite lock file. Each occurrence is claimed by exactly one node;
the job writes through a SQL fence with its claim's token, which rises with the run time
(the job's token scope), so a stale node's late write would be rejected. The parent
starts the nodes, lets them run for a few seconds and prints the ledger.
Run: uv run python examples/apscheduler_cluster.py
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from apscheduler.events import EVENT_JOB_MISSED, JobExecutionEvent
from apscheduler.schedulers.background import BackgroundScheduler

import asynclock
from asynclock.fence import SQLFence
from asynclock_apscheduler import ClaimingExecutor, current_occurrence

SECONDS = 5


def report(ledger: Path, node: str) -> None:
    """The job: one row per occurrence, written under the claim's fencing token."""
    occurrence = current_occurrence()
    conn = sqlite3.connect(ledger, isolation_level=None, timeout=10)
    try:
        with SQLFence().sqlite_transaction(conn, "report", occurrence.token):
            conn.execute(
                "INSERT INTO ledger VALUES (?, ?, ?)",
                (occurrence.run_time.isoformat(), node, occurrence.token),
            )
    except asynclock.StaleToken:
        pass  # a newer occurrence already wrote: this node was too late
    finally:
        conn.close()


def missed(node: str, event: JobExecutionEvent) -> None:
    print(f"{node}: occurrence {event.scheduled_run_time} was missed", flush=True)


def node(tmp: Path, name: str) -> None:
    scheduler = BackgroundScheduler(
        timezone="UTC",
        executors={"default": ClaimingExecutor(f"sqlite:///{tmp / 'locks.db'}", claim_ttl=10)},
    )
    # misfire_grace_time (2 s) + clock_skew (1 s, the default) < claim_ttl (10 s).
    scheduler.add_job(
        report,
        "cron",
        second="*",
        id="report",
        args=[tmp / "ledger.db", name],
        misfire_grace_time=2,
    )
    # An occurrence no node could claim in time (the lock server unreachable until the
    # takeover window ended, or in its restart grace) is reported missed, never dropped.
    scheduler.add_listener(lambda event: missed(name, event), EVENT_JOB_MISSED)
    scheduler.start()
    sys.stdin.readline()  # the parent closes our stdin to stop us
    scheduler.shutdown()


def main(tmp: Path) -> None:
    with sqlite3.connect(tmp / "ledger.db") as conn:
        SQLFence().create_sqlite(conn)
        conn.execute("CREATE TABLE ledger (run_time TEXT, node TEXT, token INTEGER)")
    nodes = [
        subprocess.Popen(
            [sys.executable, __file__, "--node", str(tmp), f"node-{i}"], stdin=subprocess.PIPE
        )
        for i in range(3)
    ]
    time.sleep(SECONDS)
    for process in nodes:
        assert process.stdin is not None
        process.stdin.close()
    for process in nodes:
        process.wait(timeout=30)
    with sqlite3.connect(tmp / "ledger.db") as conn:
        rows = conn.execute("SELECT run_time, node, token FROM ledger ORDER BY run_time").fetchall()
    for run_time, name, token in rows:
        print(f"{run_time} ran on {name} with token {token}")
    times = [row[0] for row in rows]
    tokens = [row[2] for row in rows]
    once = len(times) == len(set(times))
    print(f"{len(rows)} occurrences, each once: {once}; tokens rise: {tokens == sorted(tokens)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--node"]:
        node(Path(sys.argv[2]), sys.argv[3])
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
