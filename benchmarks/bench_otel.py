"""What ``asynclock.otel`` costs per uncontended hold (``async with backend.lock(...)``).

Rows, each on its own ``memory://`` backend in one process:

* **none**: no instrumentation (the backend's plain hold path);
* **none (control)**: the same on a second backend: its difference from **none** is what
  this measurement cannot tell apart from nothing (backends' placement in memory, order);
* **API only**: ``asynclock.otel.instrument(backend)`` with no SDK configured (the global
  providers are the API's default proxies), what an application with only
  ``opentelemetry-api`` installed (the ``otel`` extra) runs: ``instrument`` then installs
  nothing on the hold path;
* **SDK metrics**: an SDK ``MeterProvider`` with an ``InMemoryMetricReader`` (spans: the
  API's no-op tracer);
* **SDK metrics + spans**: that, and an SDK ``TracerProvider`` exporting every acquire span
  to an ``InMemorySpanExporter`` through a ``SimpleSpanProcessor`` (cleared each rep).

Each rep runs ``--cycles`` holds of every row back to back, the rows' order rotating
from rep to rep; the table gives each row's median µs per hold and its median paired
difference over **none**. Target (issue 26): API only at most 1 µs over none. A
comparison table, not a pass/fail test. Needs the dev group (the SDK).

Usage::

    uv run python -m benchmarks.bench_otel [--reps N] [--cycles N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio

import asynclock
import asynclock.otel

ROWS = ("none", "none (control)", "API only", "SDK metrics", "SDK metrics + spans")


async def run(reps: int, cycles: int) -> dict[str, list[float]]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    per_hold: dict[str, list[float]] = {row: [] for row in ROWS}
    async with AsyncExitStack() as stack:
        cycle: dict[str, Callable[[], Awaitable[None]]] = {}
        for row in ROWS:
            backend = await stack.enter_async_context(asynclock.connect("memory://"))
            if row == "API only":
                asynclock.otel.instrument(backend)
            elif row == "SDK metrics":
                asynclock.otel.instrument(backend, meter_provider=meters)
            elif row == "SDK metrics + spans":
                asynclock.otel.instrument(backend, meter_provider=meters, tracer_provider=tracers)
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
            exporter.clear()
        reader.get_metrics_data()  # the reader works (and has what the holds recorded)
    return per_hold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=2000)
    args = parser.parse_args()
    per_hold = anyio.run(run, args.reps, args.cycles)
    base = per_hold["none"]
    print(f"µs per uncontended hold, memory://, {args.reps} reps x {args.cycles} holds")
    print(f"{'row':<22} {'median':>8} {'over none (paired median)':>27}")
    for row in ROWS:
        values = per_hold[row]
        over = statistics.median(v - b for v, b in zip(values, base, strict=True))
        extra = "" if row == "none" else f"{over:>+27.2f}"
        print(f"{row:<22} {statistics.median(values):>8.2f} {extra}")


if __name__ == "__main__":
    main()
