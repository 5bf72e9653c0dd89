"""APScheduler integration benchmark: claim overhead per occurrence, exactly-once under faults.

Part A — **claim overhead per occurrence**, one process, per backend: a paused
``BackgroundScheduler`` whose executor gets ``submit_job(job, [run_time])`` directly, one
occurrence at a time (a new run time each), for a job that does nothing. Measured: from
``submit_job`` to the job body starting, and the whole occurrence (to APScheduler's
``EVENT_JOB_EXECUTED``, i.e. after the claim was kept with ``let_expire``), for a plain
``ThreadPoolExecutor`` and for ``ClaimingExecutor`` around one. Reported: p50/p99 in ms and
the claiming executor's extra cost (p50 difference).

Part B — **exactly once out of N under a fault schedule**, per backend: three scheduler
processes (``tests/support/apscheduler_node.py``) on one cron schedule (every second),
each job body running 0.3 s and writing through a SQL fence keyed by the occurrence.
Faults, in order, each as the node starts a job body (so it hits a run in progress): node
0 is frozen (SIGSTOP) for claim_ttl + 1 s, then thawed; node 1 is killed (SIGKILL) and a
new process started in its place; then a late node joins. Per occurrence in the window,
counted from the fenced ledger: once (exactly one accepted write), duplicated (two or
more), missed (none); and taken over (started on two nodes: its claimant was frozen or
killed mid-run and a waiting node re-ran it, the stale run's late write rejected by the
fence). Target: N/N once, 0 duplicates, 0 missed while at least one node is healthy.

Usage::

    uv run python -m benchmarks.bench_apscheduler [--cycles N] [--occurrences N]
        [--backends sqlite,redis,postgres] [--quick]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvloop
from apscheduler.events import EVENT_JOB_EXECUTED
from apscheduler.executors.base import BaseExecutor
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from asynclock._harness import worker_env
from asynclock_apscheduler import ClaimingExecutor
from benchmarks import _loops as loops

ROOT = Path(__file__).resolve().parents[1]


# -- servers --------------------------------------------------------------------------------


@contextlib.contextmanager
def servers(names: list[str], tmp: Path) -> Iterator[dict[str, str]]:
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if "sqlite" in names:
            urls["sqlite"] = f"sqlite:///{tmp / 'locks.db'}"
        if "redis" in names:
            from tests.support.redis_servers import RedisFactory

            factory = RedisFactory(tmp / "redis")
            stack.callback(factory.close)
            urls["redis"] = factory().url
        if "postgres" in names:
            from tests.support.pg_servers import PgServer, _own, find_pg_bin, free_port

            root = Path(tempfile.mkdtemp(prefix="asynclock-bench-pg-"))
            _own(root)
            server = PgServer(find_pg_bin(), root, free_port())
            stack.callback(shutil.rmtree, root, True)
            server.init(durable=True)
            server.start()
            stack.callback(server.stop, "immediate")
            server.psql_setup()
            urls["postgres"] = server.url() + "?mode=lease"
        yield urls


# -- part A: claim overhead -----------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def overhead(executor: BaseExecutor, cycles: int) -> tuple[list[float], list[float]]:
    """(submit -> body start, submit -> EVENT_JOB_EXECUTED) in ms, per occurrence."""
    began = threading.Event()
    executed = threading.Event()
    body_at = [0.0]

    def body() -> None:
        body_at[0] = time.perf_counter()
        began.set()

    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_executor(executor, "default")
    job = scheduler.add_job(
        body,
        "date",
        run_date=datetime.now(UTC) + timedelta(days=1),
        id=f"b{uuid.uuid4().hex[:6]}",
        misfire_grace_time=5,
    )
    scheduler.add_listener(lambda event: executed.set(), EVENT_JOB_EXECUTED)
    scheduler.start(paused=True)
    to_body: list[float] = []
    whole: list[float] = []
    try:
        for i in range(cycles + cycles // 10):
            began.clear()
            executed.clear()
            run_time = datetime.now(UTC)
            t0 = time.perf_counter()
            executor.submit_job(job, [run_time])
            if not executed.wait(10) or not began.is_set():
                raise RuntimeError("occurrence did not run (is the lock server up?)")
            if i >= cycles // 10:  # the first tenth warms up
                to_body.append((body_at[0] - t0) * 1000)
                whole.append((time.perf_counter() - t0) * 1000)
    finally:
        scheduler.shutdown()
    return to_body, whole


def part_a(urls: dict[str, str], cycles: int) -> None:
    print(f"\nPart A: claim overhead per occurrence ({cycles} occurrences, one at a time), ms")
    header = (
        f"{'executor':<34} {'to body p50':>11} {'p99':>7} {'whole p50':>10} {'p99':>7} "
        f"{'extra p50':>10}"
    )
    print(header)
    print("-" * len(header))
    base_body, base_whole = overhead(ThreadPoolExecutor(4), cycles)
    b50 = statistics.median(base_body)
    w50 = statistics.median(base_whole)
    print(
        f"{'ThreadPoolExecutor (no claim)':<34} {b50:>11.3f} {percentile(base_body, 0.99):>7.3f} "
        f"{w50:>10.3f} {percentile(base_whole, 0.99):>7.3f} {'':>10}"
    )
    for name, url in urls.items():
        body, whole = overhead(ClaimingExecutor(url, claim_ttl=10.0), cycles)
        p50 = statistics.median(whole)
        print(
            f"{'ClaimingExecutor ' + name:<34} {statistics.median(body):>11.3f} "
            f"{percentile(body, 0.99):>7.3f} {p50:>10.3f} {percentile(whole, 0.99):>7.3f} "
            f"{p50 - w50:>+10.3f}"
        )


# -- part B: exactly once under faults ------------------------------------------------------


class Node:
    def __init__(
        self, url: str, config: dict[str, Any], events: list[tuple[int, dict[str, Any]]], index: int
    ) -> None:
        payload = json.dumps({"url": url, "options": {}, **config})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.apscheduler_node", payload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(),
            text=True,
        )
        self.started = threading.Event()
        self.job_started = threading.Event()
        self.index = index
        self._events = events
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            event = json.loads(line)
            self._events.append((self.index, event))
            if event["event"] == "started":
                self.started.set()
            elif event["event"] == "job_started":
                self.job_started.set()

    def next_job(self, timeout: float = 10.0) -> None:
        """Wait until this node starts a job body (a fault then hits a run in progress;
        if this node claims nothing for ``timeout`` seconds, the fault hits it idle)."""
        self.job_started.clear()
        self.job_started.wait(timeout)

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.process.stdin is not None
                self.process.stdin.write("stop\n")
                self.process.stdin.flush()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def part_b(name: str, url: str, occurrences: int, tmp: Path) -> None:
    claim_ttl = 2.0
    config = {
        "kind": "background",
        "job_id": f"fleet-{uuid.uuid4().hex[:6]}",
        "trigger": "cron",
        "claim_ttl": claim_ttl,
        "grace": 1.0,
        "skew": 0.5,
        "work": 0.3,
        "ledger": str(tmp / f"ledger-{name}.db"),
        # A takeover's token is larger than those of occurrences claimed meanwhile, so
        # fence each occurrence on its own key (a job-wide key would reject those).
        "fence": "occurrence",
        # A takeover arrives while the node may run a later occurrence: room for both.
        "max_instances": 2,
    }
    events: list[tuple[int, dict[str, Any]]] = []
    nodes = [Node(url, config, events, i) for i in range(3)]
    try:
        for node in nodes:
            if not node.started.wait(30):
                raise RuntimeError(f"{name}: a scheduler process did not start")
        first = (datetime.now(UTC) + timedelta(seconds=1)).replace(microsecond=0)
        step = max(2.0, occurrences / 4)
        time.sleep(step)
        nodes[0].next_job()
        nodes[0].signal(signal.SIGSTOP)
        time.sleep(claim_ttl + 1)
        nodes[0].signal(signal.SIGCONT)
        time.sleep(max(0.0, step - claim_ttl - 1))
        nodes[1].next_job()
        nodes[1].signal(signal.SIGKILL)
        nodes[1].process.wait()
        nodes.append(Node(url, config, events, 3))
        time.sleep(step)
        nodes.append(Node(url, config, events, 4))
        end = first + timedelta(seconds=occurrences)
        time.sleep(max(0.0, (end - datetime.now(UTC)).total_seconds() + 1.5))
    finally:
        for node in nodes:
            node.stop()
    window = [(first + timedelta(seconds=s)).isoformat() for s in range(occurrences)]
    started: dict[str, list[int]] = {}
    stale: set[str] = set()
    late_accepted: set[str] = set()
    for _, event in events:
        if event["event"] == "job_started":
            started.setdefault(event["run_time"], []).append(event["token"])
        elif event["event"] == "late_write" or (
            event["event"] == "ran" and event["result"] == "stale"
        ):
            # A frozen run that, thawed, finished its loop before the loss reached it
            # writes as usual ("ran"): the fence is what stops that write.
            (stale if event["result"] == "stale" else late_accepted).add(event["run_time"])
    with sqlite3.connect(str(config["ledger"])) as conn:
        rows = conn.execute("SELECT writer, token FROM ledger").fetchall()
    accepted: dict[str, int] = {}
    for writer, _ in rows:
        accepted[writer] = accepted.get(writer, 0) + 1
    once = sum(1 for t in window if accepted.get(t) == 1)
    dup = sum(1 for t in window if accepted.get(t, 0) > 1)
    missed = sum(1 for t in window if t not in accepted)
    taken = sum(1 for t in window if len(started.get(t, ())) > 1)
    # First claims (not taken over) carry tokens that rise with the run time.
    firsts = [tokens[0] for _, tokens in sorted(started.items()) if len(tokens) == 1]
    print(
        f"{name:<10} {once:>4}/{occurrences:<4} {dup:>10} {missed:>7} {taken:>10} "
        f"{f'{len(stale)}/{len(late_accepted)}':>11} {firsts == sorted(set(firsts))!s:>12}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--occurrences", type=int, default=30)
    parser.add_argument("--backends", default="sqlite,redis,postgres")
    parser.add_argument(
        "--quick", action="store_true", help="sqlite only, 50 cycles, 10 occurrences"
    )
    # Part A's: the executor's loop thread makes its loop with asyncio.new_event_loop(), so
    # uvloop is had through the event-loop policy. Part B's schedulers are processes of
    # their own, on asyncio.
    loops.add_option(parser)
    args = parser.parse_args()
    names = [b for b in args.backends.split(",") if b]
    if args.quick:
        names, args.cycles, args.occurrences = ["sqlite"], 50, 10
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp_name, servers(names, Path(tmp_name)) as urls:
        tmp = Path(tmp_name)
        for loop in loops.chosen(args):
            loops.heading(loop)
            policy = uvloop.EventLoopPolicy() if loop == "uvloop" else None
            asyncio.set_event_loop_policy(policy)
            try:
                part_a(urls, args.cycles)
            finally:
                asyncio.set_event_loop_policy(None)
        print(
            f"\nPart B: {args.occurrences} one-second occurrences, 3 schedulers, faults: "
            "SIGSTOP one past its claim, SIGKILL + restart one, a late node joins"
        )
        header = (
            f"{'backend':<10} {'once':>9} {'duplicated':>10} {'missed':>7} {'taken over':>10} "
            f"{'late s/a':>11} {'tokens rise':>12}"
        )
        print(header)
        print("-" * len(header))
        for name, url in urls.items():
            part_b(name, url, args.occurrences, tmp)
        print(
            "\ntaken over = its claimant was frozen or killed mid-run and another node re-ran "
            "it; late s/a = the interrupted runs' late writes rejected (stale) / accepted by "
            "the fence; tokens rise = first claims' tokens rise with the run time"
        )


if __name__ == "__main__":
    main()
