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
* **load** (``--load``) — one process, 200 concurrent tasks over 50 names on Redis for
  ``--load-seconds`` (30): holds/s, errors, leases left held, and peak RSS.

Usage::

    uv run python -m benchmarks.bench_drill                      # 16 workers x 60 s drill
    uv run python -m benchmarks.bench_drill --workers 8 --duration 15 --seconds 5 --reps 3

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import anyio

import asynclock
import asynclock.drill
from asynclock._harness import Hold, WorkerGroup, Write
from asynclock._harness.history import overlaps, tokens_out_of_order
from asynclock._harness.register import open_register
from asynclock._harness.report import judge
from asynclock._harness.servers import RedisServer


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


async def _load(url: str, seconds: float) -> None:
    names = [f"load-{i}" for i in range(50)]
    holds = errors = 0
    samples = [rss_mb()]
    async with asynclock.connect(url) as backend:
        end = time.monotonic() + seconds

        async def sample() -> None:
            while time.monotonic() < end:
                await anyio.sleep(1)
                samples.append(rss_mb())

        async def task(i: int) -> None:
            nonlocal holds, errors
            r = 0
            while time.monotonic() < end:
                try:
                    async with backend.lock(names[(i + r) % 50], ttl=10.0, timeout=30):
                        holds += 1
                except asynclock.AsynclockError:
                    errors += 1
                r += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(sample)
            for i in range(200):
                tg.start_soon(task, i)
        held = backend.stats().held
    print(f"  {holds / seconds:10.1f} holds/s   errors {errors}   held after {held}")
    print(
        f"  RSS: {samples[0]:.1f} MB at start, peak {max(samples):.1f} MB, "
        f"{samples[-1]:.1f} MB at the end (sampled every second)"
    )


def part_load(seconds: float) -> None:
    print(f"\n## load: 200 tasks x 50 names on Redis for {seconds:g} s, one process")
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            anyio.run(_load, server.url, seconds)
        finally:
            server.stop()


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
        part_load(args.load_seconds)


if __name__ == "__main__":
    main()
