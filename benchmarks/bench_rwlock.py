"""A mixed read-write stress run on one read-write lock (issue 42: "read-write: writer
tokens strictly increase, readers share the epoch, no writer waits more than a bounded
time in a 60 s mixed stress run").

Run: ``uv run --group bench python -m benchmarks.bench_rwlock [--seconds 60]`` (or as a
script). Starts its own redis-server and uses a throwaway SQLite file; ``--backends``
picks (default ``sqlite,redis``). Per backend, ``--readers`` reader tasks and
``--writers`` writer tasks, each on a backend (a connection, an owner) of its own, take
``backend.rwlock(NAME)`` again and again for ``--seconds``: a read holds 0-10 ms, a write
0-5 ms, a writer thinks 50-150 ms between writes, a reader 0-5 ms (so readers overlap
without a gap: only writer preference lets a writer in). Every hold enters a probe
resource that records:

* **overlaps**: a writer beside a reader or another writer (must be 0);
* **writer tokens**: each write hold's token must be above every earlier one (must be 0
  violations) and **reader epochs**: each read hold's token must be the epoch of the last
  write the probe saw (readers share the epoch current at their grant; 0 violations);
* **max writer wait**: from asking for the write hold to holding it; checked against
  ``--bound`` seconds (writer preference: a waiting writer keeps new readers out, so it
  waits for the readers already in and for the other writers, with the waits' polling).

It prints one row per backend: holds per second of each mode, the max (and p99) writer
wait, and the violations. The suite runs the same function for 5 s on SQLite and Redis
(``tests/test_rwlock_stress.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import anyio

import asynclock

#: The writer wait the run holds itself to (seconds): see the module.
BOUND = 2.0
TTL = 5.0


@dataclass
class Probe:
    """The resource every hold enters: it sees who is in and what token each carries."""

    readers: int = 0
    writer: bool = False
    epoch: int | None = None  # the last write's token seen (None: no write yet)
    overlaps: int = 0
    token_violations: int = 0
    epoch_violations: int = 0
    reads: int = 0
    writes: int = 0
    waits: list[float] = field(default_factory=list)

    def enter_read(self, token: int) -> None:
        if self.writer:
            self.overlaps += 1
        if self.epoch is None:
            self.epoch = token  # the epoch before the run's first write
        elif token != self.epoch:
            self.epoch_violations += 1
        self.readers += 1
        self.reads += 1

    def exit_read(self) -> None:
        self.readers -= 1

    def enter_write(self, token: int) -> None:
        if self.writer or self.readers:
            self.overlaps += 1
        if self.epoch is not None and token <= self.epoch:
            self.token_violations += 1
        self.epoch = token
        self.writer = True
        self.writes += 1

    def exit_write(self) -> None:
        self.writer = False


@dataclass(frozen=True)
class Report:
    url: str
    seconds: float
    reads_per_s: float
    writes_per_s: float
    max_wait: float
    p99_wait: float
    overlaps: int
    token_violations: int
    epoch_violations: int
    lost: int

    @property
    def violations(self) -> int:
        return self.overlaps + self.token_violations + self.epoch_violations


async def stress(
    url: str, seconds: float, *, readers: int = 8, writers: int = 3, name: str | None = None
) -> Report:
    """Readers and writers, a backend each, on one rwlock of ``url`` for ``seconds``."""
    name = name or f"bench-rw:{uuid.uuid4().hex[:8]}"
    probe = Probe()
    lost = 0
    stop_at = time.monotonic() + seconds

    async def reader(backend: asynclock.Backend) -> None:
        nonlocal lost
        rw = backend.rwlock(name)
        while time.monotonic() < stop_at:
            try:
                async with rw.read(ttl=TTL, timeout=30) as r:
                    probe.enter_read(r.token)
                    try:
                        await anyio.sleep(random.uniform(0, 0.010))
                    finally:
                        probe.exit_read()
            except asynclock.LeaseLost:
                lost += 1
            await anyio.sleep(random.uniform(0, 0.005))

    async def writer(backend: asynclock.Backend) -> None:
        nonlocal lost
        rw = backend.rwlock(name)
        while time.monotonic() < stop_at:
            asked = time.monotonic()
            try:
                async with rw.write(ttl=TTL, timeout=30) as w:
                    probe.waits.append(time.monotonic() - asked)
                    probe.enter_write(w.token)
                    try:
                        await anyio.sleep(random.uniform(0, 0.005))
                    finally:
                        probe.exit_write()
            except asynclock.LeaseLost:
                lost += 1
            await anyio.sleep(random.uniform(0.050, 0.150))

    async with contextlib.AsyncExitStack() as stack:
        backends = [
            await stack.enter_async_context(asynclock.connect(url))
            for _ in range(readers + writers)
        ]
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for b in backends[:readers]:
                tg.start_soon(reader, b)
            for b in backends[readers:]:
                tg.start_soon(writer, b)
        elapsed = time.monotonic() - started
    waits = sorted(probe.waits) or [0.0]
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    return Report(
        url=url,
        seconds=elapsed,
        reads_per_s=probe.reads / elapsed,
        writes_per_s=probe.writes / elapsed,
        max_wait=waits[-1],
        p99_wait=p99,
        overlaps=probe.overlaps,
        token_violations=probe.token_violations,
        epoch_violations=probe.epoch_violations,
        lost=lost,
    )


def table(reports: list[Report], bound: float) -> str:
    head = (
        f"{'backend':<10} {'s':>5} {'reads/s':>8} {'writes/s':>8} {'max wait':>9} "
        f"{'p99 wait':>9} {'overlaps':>8} {'tokens':>6} {'epochs':>6} {'lost':>4}  bound"
    )
    rows = [head]
    for r in reports:
        ok = "ok" if r.max_wait <= bound and r.violations == 0 else "FAIL"
        rows.append(
            f"{r.url.partition(':')[0]:<10} {r.seconds:>5.1f} {r.reads_per_s:>8.0f} "
            f"{r.writes_per_s:>8.1f} {r.max_wait * 1000:>7.0f}ms {r.p99_wait * 1000:>7.0f}ms "
            f"{r.overlaps:>8} {r.token_violations:>6} {r.epoch_violations:>6} {r.lost:>4}  "
            f"{ok} (<= {bound:g}s)"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per backend (default 60)")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--bound", type=float, default=BOUND, help="max writer wait (s)")
    parser.add_argument("--backends", default="sqlite,redis", help="sqlite, redis or both")
    args = parser.parse_args()
    from tests.support.redis_servers import RedisFactory

    reports = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        for which in args.backends.split(","):
            if which == "sqlite":
                url = f"sqlite:///{Path(tmp) / 'rw.db'}"
            else:
                factory = RedisFactory(Path(tmp))
                stack.callback(factory.close)
                url = factory().url
            run = functools.partial(
                stress, url, args.seconds, readers=args.readers, writers=args.writers
            )
            report = anyio.run(run)
            reports.append(report)
    print(f"{args.readers} readers, {args.writers} writers, one rwlock, ttl {TTL:g}s")
    print(table(reports, args.bound))
    failed = any(r.violations or r.max_wait > args.bound for r in reports)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
