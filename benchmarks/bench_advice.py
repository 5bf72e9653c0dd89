"""What ``backend.collect_advice()`` costs: time per uncontended hold, and memory of the
per-template sketches as the number of distinct names grows.

Time rows, each on its own ``memory://`` backend in one process (as ``bench_otel``):

* **none**: no observer (the plain hold path);
* **none (control)**: the same on a second backend (what this cannot tell from nothing);
* **empty observer**: an observer whose hooks do nothing, installed through the core's
  seam: what the seam costs (the wrappers of acquire and release), without advice;
* **advice**: ``backend.collect_advice()``: a hold-time sketch per name template.

Each rep runs ``--cycles`` holds of every row back to back, the rows' order rotating; the
table gives each row's median µs per hold and its median paired difference over **none**.

Memory: one backend collecting advice holds ``N`` distinct names, ``N`` in 100, 1,000 and
10,000, each name its own template (``"bench{i}:x"``, the worst case), under the default
cap of 1,000 templates; ``tracemalloc`` measures what the collector keeps (sketches, the
template dict) after the holds, and the table gives the templates kept and the bytes.
A comparison table, not a pass/fail test.

Usage::

    uv run python -m benchmarks.bench_advice [--reps N] [--cycles N] [--names N ...]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio

import asynclock
from asynclock._core.observer import Observer

ROWS = ("none", "none (control)", "empty observer", "advice")


async def timing(reps: int, cycles: int) -> dict[str, list[float]]:
    per_hold: dict[str, list[float]] = {row: [] for row in ROWS}
    async with AsyncExitStack() as stack:
        cycle: dict[str, Callable[[], Awaitable[None]]] = {}
        for row in ROWS:
            backend = await stack.enter_async_context(asynclock.connect("memory://"))
            if row == "advice":
                backend.collect_advice()
            elif row == "empty observer":
                backend.add_observer(Observer())
            lock = backend.lock(f"bench:{row}", ttl=60.0)

            async def hold(lock: asynclock.Lock = lock) -> None:
                for _ in range(cycles):
                    async with lock:
                        pass

            cycle[row] = hold
        for row in ROWS:  # warm up
            await cycle[row]()
        for rep in range(reps):
            order = ROWS[rep % len(ROWS) :] + ROWS[: rep % len(ROWS)]
            for row in order:
                started = time.perf_counter()
                await cycle[row]()
                per_hold[row].append((time.perf_counter() - started) / cycles * 1e6)
    return per_hold


async def memory(names: int) -> tuple[int, int, int]:
    """(templates kept, bytes the collector holds after ``names`` names, sketch counts)."""
    async with asynclock.connect("memory://") as backend:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        backend.collect_advice()
        for i in range(names):
            async with backend.lock(f"bench{i}:x", ttl=60.0):
                pass
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        collector = backend._advice
        assert collector is not None
        kept = sum(
            stat.size_diff
            for stat in after.compare_to(before, "lineno")
            if stat.traceback[0].filename.endswith(("_core/advice.py", "_core/sketch.py"))
        )
        return len(collector.templates), kept, collector.memory_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--names", type=int, nargs="+", default=[100, 1000, 10_000])
    args = parser.parse_args()
    per_hold = anyio.run(timing, args.reps, args.cycles)
    base = per_hold["none"]
    print(f"µs per uncontended hold, memory://, {args.reps} reps x {args.cycles} holds")
    print(f"{'row':<16} {'median':>8} {'over none (paired median)':>27}")
    for row in ROWS:
        values = per_hold[row]
        over = statistics.median(v - b for v, b in zip(values, base, strict=True))
        extra = "" if row == "none" else f"{over:>+27.2f}"
        print(f"{row:<16} {statistics.median(values):>8.2f} {extra}")
    print()
    print("memory of advice collection (default cap: 1000 templates, then '(other)')")
    print(f"{'names':>8} {'templates':>10} {'bytes (tracemalloc)':>20} {'sketch counts':>14}")
    for n in args.names:
        templates, kept, counts = anyio.run(memory, n)
        print(f"{n:>8} {templates:>10} {kept:>20,} {counts:>14,}")


if __name__ == "__main__":
    main()
