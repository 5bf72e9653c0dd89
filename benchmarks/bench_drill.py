"""The drill must scale: a big drill on Redis, the recorder's cost, the checker's speed.

Three parts (``--parts drill,recorder,checker``; ``--load`` adds the long load run):

* **drill** — ``asynclock.drill.run(spawn="redis")`` with W workers for S seconds and every
  fault (default 16 x 60 s, as issue 14 asks); prints the summary counters, the faults, the
  wall time and whether the verdict was clean.
* **recorder** — the workers' cycle time (acquire → read → work → fenced write → release,
  on one Redis) with the step-by-step recording on (a JSON line per step on the pipe, read
  by the parent) and off (``--no-record``: the worker only counts). W workers run for S
  seconds each way, ``--reps`` times interleaved; the medians of the mean cycle time are
  compared. Target: recording adds ≤ 5 %.
* **checker** — the drill's checks (the harness's overlap and token-order checks plus the
  drill's own store-order check) over synthetic histories of 10k, 100k and 1M events:
  events/s at each size (linear if it stays flat).
* **load** (``--load``) — 200 concurrent tasks over 50 names for ``--load-seconds`` (30)
  on every backend in turn (``--load-backends``: memory, sqlite, redis, redlock with 3
  nodes, postgres in both modes, etcd with 3 members; each on servers of its own): holds/s,
  errors, leases left held or lost, tasks left over, and the process's RSS at the start, its
  peak and at the end (sampled every second).

Usage::

    uv run python -m benchmarks.bench_drill                      # 16 workers x 60 s drill
    uv run python -m benchmarks.bench_drill --workers 8 --duration 15 --seconds 5 --reps 3
    uv run python -m benchmarks.bench_drill --parts none --load  # 30 s per backend

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

import asynclock
import asynclock.drill
from asynclock._harness import Hold, WorkerGroup, Write
from asynclock._harness.history import overlaps, tokens_out_of_order
from asynclock._harness.pg_server import running_pg
from asynclock._harness.register import open_register
from asynclock._harness.report import judge
from asynclock._harness.servers import EtcdServers, RedisServer
from benchmarks import _loops as loops


def part_drill(workers: int, duration: float) -> None:
    print(f"\n## drill: {workers} workers x {duration:g} s on Redis, all faults")
    t0 = time.monotonic()
    report = asynclock.drill.run(spawn="redis", workers=workers, duration=duration, ttl=0.5)
    wall = time.monotonic() - t0
    for key, value in report.counters().items():
        print(f"  {key:<24} {value:>8}")
    kinds = {k: sum(f.kind == k for f in report.faults) for k in asynclock.drill.FAULTS}
    print("  faults by kind           " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    print(f"  acquisitions/s           {report.acquisitions / duration:8.1f}")
    print(f"  wall time                {wall:8.1f} s (servers and workers started and stopped)")
    print(
        f"  verdict                  {'OK' if report.ok else 'PROBLEMS: ' + str(report.problems)}"
    )


async def _cycle_time(url: str, workers: int, seconds: float, record: bool) -> float:
    """Mean seconds per worker cycle, over ``workers`` workers running ``seconds``."""
    run = os.urandom(4).hex()
    spec = f"{url}#bench-drill:{run}"
    register = open_register(spec)
    await register.setup()
    await register.aclose()
    argv = [
        "-m",
        "asynclock._harness.drill_worker",
        "--url",
        url,
        "--register",
        spec,
        "--name",
        f"bench-{run}",
        "--ttl",
        "2.0",
        "--work",
        "0.0",
        "--parent",
        str(os.getpid()),
    ]
    if not record:
        argv.append("--no-record")
    per_cycle: list[float] = []
    async with WorkerGroup() as group, anyio.create_task_group() as tg:
        procs = [await group.start(argv, label=f"w{i}", timeout=60) for i in range(workers)]
        for proc in procs:
            await proc.expect("ready", 60)
        done: dict[str, dict[str, float]] = {}

        async def drain(proc: asynclock._harness.Worker) -> None:
            while True:
                for event in await proc.next_events(timeout=seconds + 60):
                    if event.get("event") == "done":
                        done[proc.label] = event
                        return

        for proc in procs:
            tg.start_soon(drain, proc)
        await anyio.sleep(seconds)  # the measured run's length, not a synchronisation
        for proc in procs:
            await proc.send("stop")
    for event in done.values():
        per_cycle.append(float(event["elapsed"]) / max(1, int(event["cycles"])))
    return statistics.mean(per_cycle)


def part_recorder(workers: int, seconds: float, reps: int) -> None:
    print(f"\n## recorder overhead: {workers} workers x {seconds:g} s, {reps} reps interleaved")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            on: list[float] = []
            off: list[float] = []
            for _ in range(reps):
                off.append(anyio.run(_cycle_time, server.url, workers, seconds, False))
                on.append(anyio.run(_cycle_time, server.url, workers, seconds, True))
        finally:
            server.stop()
    a, b = statistics.median(off), statistics.median(on)
    print(
        f"  recording off   {a * 1000:8.3f} ms/cycle   (runs: "
        + ", ".join(f"{x * 1000:.3f}" for x in off)
        + ")"
    )
    print(
        f"  recording on    {b * 1000:8.3f} ms/cycle   (runs: "
        + ", ".join(f"{x * 1000:.3f}" for x in on)
        + ")"
    )
    print(f"  overhead        {(b / a - 1) * 100:+8.1f} %   (target: <= 5 %)")


def _history(n: int, workers: int = 16) -> tuple[list[Hold], list[Write]]:
    rng = random.Random(n)
    holds, writes = [], []
    t = 0.0
    for i in range(n // 2):
        w = f"w{rng.randrange(workers)}"
        start, t = t, t + rng.uniform(0.001, 0.01)
        holds.append(Hold(w, start, t, i + 1, "bench"))
        writes.append(Write(w, t - 0.0005, i + 1, True, "register"))
    return holds, writes


def part_checker() -> None:
    print("\n## checker: events/s over synthetic histories (holds + writes)")
    for n in (10_000, 100_000, 1_000_000):
        holds, writes = _history(n)
        report = asynclock.drill.DrillReport("bench", "", True, 16, 0, 0.5)
        report.holds, report.writes = holds, writes
        report.sent = [h.start - 0.0001 for h in holds]
        report.values = list(range(1, len(writes) + 1))
        report.late = [False] * len(writes)
        report.final = report.applied = len(writes)
        t0 = time.perf_counter()
        found = len(overlaps(holds)) + len(tokens_out_of_order(holds))
        judge(report)
        elapsed = time.perf_counter() - t0
        print(
            f"  {n:>9,} events  {elapsed:7.3f} s  {n / elapsed:>12,.0f} events/s  "
            f"(problems found: {found + len(report.problems)})"
        )


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


#: Backends the load part runs on, each on throwaway servers of its own.
LOAD_BACKENDS = ("memory", "sqlite", "redis", "redlock", "postgres", "postgres-lease", "etcd")


@contextlib.contextmanager
def _load_target(kind: str, tmp: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(url, connect options) for ``kind`` on servers started for this run alone."""
    if kind == "memory":
        yield "memory://", {}
    elif kind == "sqlite":
        yield f"sqlite:///{tmp / 'load.db'}", {}
    elif kind in ("redis", "redlock"):
        nodes = [RedisServer(tmp / f"redis{i}").start() for i in range(1 if kind == "redis" else 3)]
        try:
            if kind == "redis":
                yield nodes[0].url, {}
            else:  # 1 s per node: the default 0.25 s is too short for 200 first acquires here
                yield "redlock://" + ",".join(n.address for n in nodes), {"node_timeout": 1.0}
        finally:
            for node in nodes:
                node.stop()
    elif kind in ("postgres", "postgres-lease"):
        with running_pg("bench-drill-load-") as pg:
            yield pg.url() + ("?mode=lease" if kind == "postgres-lease" else ""), {}
    else:
        cluster = EtcdServers(tmp / "etcd", 3).start()
        try:
            yield cluster.url, {}
        finally:
            cluster.stop()


async def _load(url: str, options: dict[str, Any], seconds: float) -> dict[str, Any]:
    names = [f"load-{i}" for i in range(50)]
    holds = 0
    errors: collections.Counter[str] = collections.Counter()
    samples = [rss_mb()]
    tasks_before = len(asyncio.all_tasks())
    async with asynclock.connect(url, **options) as backend:
        end = time.monotonic() + seconds

        async def sample() -> None:
            while time.monotonic() < end:
                await anyio.sleep(1)
                samples.append(rss_mb())

        async def task(i: int) -> None:
            nonlocal holds
            r = 0
            while time.monotonic() < end:
                try:
                    async with backend.lock(names[(i + r) % 50], ttl=10.0, timeout=30):
                        holds += 1
                except asynclock.AsynclockError as exc:
                    errors[type(exc).__name__] += 1
                r += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            for i in range(200):
                tg.start_soon(task, i)
        stats = backend.stats()
    await anyio.sleep(0.1)  # closed transports finish their callbacks; then count
    left = len(asyncio.all_tasks()) - tasks_before
    return {
        "holds/s": holds / seconds,
        "errors": errors.total(),
        "kinds": ", ".join(f"{k} {n}" for k, n in errors.most_common()),
        "held after": stats.held,
        "lost": stats.losses,
        "tasks left": max(0, left),
        "rss": (samples[0], max(samples), samples[-1]),
    }


def part_load(seconds: float, kinds: Sequence[str], on: Sequence[str]) -> None:
    """The one part that runs asynclock in this process, so the one ``--loop`` changes (the
    drill's and the recorder's workers are processes of their own, on asyncio)."""
    print(f"\n## load: 200 tasks x 50 names for {seconds:g} s per backend, one process each")
    print(
        "  backend, loop    holds/s  errors  held after  lost  tasks left after close  "
        "RSS start / peak / end (MB)"
    )
    for kind, loop in itertools.product(kinds, on):
        with tempfile.TemporaryDirectory() as tmp, _load_target(kind, Path(tmp)) as target:
            r = loops.run(loop, _load, target[0], target[1], seconds)
        start, peak, end = r["rss"]
        print(
            f"  {kind + ' ' + loop:<15} {r['holds/s']:8.1f} {r['errors']:7d} {r['held after']:11d} "
            f"{r['lost']:5d} {r['tasks left']:23d}  {start:6.1f} / {peak:6.1f} / {end:6.1f}"
            + (f"  ({r['kinds']})" if r["kinds"] else ""),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="drill workers (default 16)")
    parser.add_argument("--duration", type=float, default=60.0, help="drill seconds (60)")
    parser.add_argument("--rec-workers", type=int, default=4, help="recorder part workers (4)")
    parser.add_argument("--seconds", type=float, default=5.0, help="recorder run seconds (5)")
    parser.add_argument("--reps", type=int, default=3, help="recorder repetitions (3)")
    parser.add_argument("--parts", default="drill,recorder,checker")
    parser.add_argument("--load", action="store_true", help="also the long load run")
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument(
        "--load-backends",
        default=",".join(LOAD_BACKENDS),
        help=f"comma-separated, from {','.join(LOAD_BACKENDS)} (default: all)",
    )
    loops.add_option(parser)  # the load part's (the others run their workers in processes)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(
        f"bench_drill: asynclock {asynclock.__version__}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if "drill" in parts:
        part_drill(args.workers, args.duration)
    if "recorder" in parts:
        part_recorder(args.rec_workers, args.seconds, args.reps)
    if "checker" in parts:
        part_checker()
    if args.load:
        part_load(args.load_seconds, args.load_backends.split(","), loops.chosen(args))


if __name__ == "__main__":
    main()
