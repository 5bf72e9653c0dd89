"""SQLite backend benchmark: asynclock's ``sqlite://`` against the floor and a naive peer.

Part A — uncontended acquire + release, one process, one name:

* floor: plain ``sqlite3`` in the calling thread: ``BEGIN IMMEDIATE`` + an upsert of a
  lease row + ``COMMIT``, then an autocommit ``DELETE`` of the row; WAL and
  ``synchronous=NORMAL``, as asynclock configures its file;
* the same two calls, each through ``anyio.to_thread.run_sync`` (the thread-hop cost);
* aiosqlite doing the same four statements, if it happens to be importable (it is not a
  dependency);
* asynclock: ``async with backend.lock(name, ttl=5.0): pass``.

Part B — 4 OS processes contend on one name, each holding it for 1 ms, for a fixed time
after a common start (workers say "ready" on a pipe; the parent then sends every worker
the same CLOCK_MONOTONIC start instant, which is system-wide on Linux). Run for asynclock
and for a naive peer (raw ``sqlite3``: ``BEGIN IMMEDIATE``, check the row, upsert,
``COMMIT``; on busy/held sleep a fixed 1 ms and retry, no queue). Each holder records its
[start, end] interval; the parent checks that no two intervals overlap.

Usage (as a module or as a script)::

    uv run python -m benchmarks.bench_sqlite [--cycles N] [--reps R] [--seconds S] [--quick]
    uv run python benchmarks/bench_sqlite.py [--cycles N] [--reps R] [--seconds S] [--quick]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

import asynclock
from asynclock._harness import Hold, WorkerGroup, emit, overlaps, tokens_out_of_order
from benchmarks import _loops as loops

LOCK_NAME = "bench"
TTL = 5.0
PROCESSES = 4
HOLD = 0.001
NAIVE_RETRY = 0.001
TARGET_RATIO = 0.5
#: Bounded retries when several processes open one file at the same moment (see README).
OPEN_ATTEMPTS = 200
OPEN_RETRY = 0.005

# Floor / naive schema: one lease row per name, the minimum a lease lock must write.
FLOOR_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS lease ("
    " name TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,"
    " expires_at REAL NOT NULL) WITHOUT ROWID"
)
# Upsert the lease row: args name, owner, token, expires_at.
FLOOR_UPSERT = (
    "INSERT INTO lease (name, owner, token, expires_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = excluded.token, "
    "expires_at = excluded.expires_at"
)
# Owner-checked release: args name, owner.
FLOOR_DELETE = "DELETE FROM lease WHERE name = ? AND owner = ?"
# Naive peer's check inside its BEGIN IMMEDIATE: args name. Returns expires_at.
NAIVE_CHECK = "SELECT expires_at FROM lease WHERE name = ?"


# -- shared helpers ------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (0 when empty)."""
    if not ordered:
        return 0.0
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def open_plain(path: Path) -> sqlite3.Connection:
    """A connection configured like asynclock's: autocommit, no busy wait, WAL, NORMAL."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
    db.execute("PRAGMA busy_timeout = 0")
    # Processes opening one file at once can see SQLITE_BUSY on this pragma; retry briefly.
    for attempt in range(OPEN_ATTEMPTS):
        try:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            break
        except sqlite3.OperationalError as exc:
            if not is_busy(exc) or attempt == OPEN_ATTEMPTS - 1:
                db.close()
                raise
            time.sleep(OPEN_RETRY)
    if str(mode).lower() != "wal":
        raise RuntimeError(f"{path}: could not switch to WAL (got {mode!r})")
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute(FLOOR_SCHEMA)
    return db


def is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return int(code) & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    """Plain aligned columns: first column left-aligned, the rest right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return indent + "  ".join(out).rstrip()

    print(line(headers))
    print(indent + "  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


# -- Part A: uncontended cycles ------------------------------------------------------------


@dataclass
class RepResult:
    seconds: float
    latencies_ns: list[int]

    @property
    def rate(self) -> float:
        return len(self.latencies_ns) / self.seconds


@dataclass
class Variant:
    label: str
    run: Callable[[Path, int], RepResult] | None
    note: str = ""
    reps: list[RepResult] = field(default_factory=list)


def floor_acquire(db: sqlite3.Connection, i: int) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(FLOOR_UPSERT, (LOCK_NAME, f"{i:032x}", i, time.monotonic() + TTL))
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def floor_release(db: sqlite3.Connection, i: int) -> None:
    db.execute(FLOOR_DELETE, (LOCK_NAME, f"{i:032x}"))


def run_floor(path: Path, n: int) -> RepResult:
    db = open_plain(path)
    try:
        warm = max(50, n // 20)
        for i in range(warm):
            floor_acquire(db, i)
            floor_release(db, i)
        lat: list[int] = []
        clock = time.perf_counter_ns
        begin = clock()
        for i in range(n):
            t0 = clock()
            floor_acquire(db, i)
            floor_release(db, i)
            lat.append(clock() - t0)
        return RepResult((clock() - begin) / 1e9, lat)
    finally:
        db.close()


def run_floor_to_thread(path: Path, n: int) -> RepResult:
    async def main() -> RepResult:
        db = open_plain(path)
        try:
            warm = max(50, n // 20)
            for i in range(warm):
                await anyio.to_thread.run_sync(floor_acquire, db, i)
                await anyio.to_thread.run_sync(floor_release, db, i)
            lat: list[int] = []
            clock = time.perf_counter_ns
            begin = clock()
            for i in range(n):
                t0 = clock()
                await anyio.to_thread.run_sync(floor_acquire, db, i)
                await anyio.to_thread.run_sync(floor_release, db, i)
                lat.append(clock() - t0)
            return RepResult((clock() - begin) / 1e9, lat)
        finally:
            db.close()

    return on_loop(main)


def make_aiosqlite_runner(module: Any) -> Callable[[Path, int], RepResult]:
    async def cycle(db: Any, i: int) -> None:
        await db.execute("BEGIN IMMEDIATE")
        await db.execute(FLOOR_UPSERT, (LOCK_NAME, f"{i:032x}", i, time.monotonic() + TTL))
        await db.execute("COMMIT")
        await db.execute(FLOOR_DELETE, (LOCK_NAME, f"{i:032x}"))

    async def main(path: Path, n: int) -> RepResult:
        open_plain(path).close()  # pragmas and schema, exactly as the floor
        async with module.connect(path, isolation_level=None, timeout=0) as db:
            await db.execute("PRAGMA busy_timeout = 0")
            await db.execute("PRAGMA synchronous = NORMAL")
            for i in range(max(50, n // 20)):
                await cycle(db, i)
            lat: list[int] = []
            clock = time.perf_counter_ns
            begin = clock()
            for i in range(n):
                t0 = clock()
                await cycle(db, i)
                lat.append(clock() - t0)
            return RepResult((clock() - begin) / 1e9, lat)

    def run(path: Path, n: int) -> RepResult:
        return on_loop(main, path, n)

    return run


def run_asynclock(path: Path, n: int) -> RepResult:
    async def main() -> RepResult:
        async with asynclock.connect(f"sqlite:///{path}") as backend:
            for _ in range(max(50, n // 20)):
                async with backend.lock(LOCK_NAME, ttl=TTL):
                    pass
            lat: list[int] = []
            clock = time.perf_counter_ns
            begin = clock()
            for _ in range(n):
                t0 = clock()
                async with backend.lock(LOCK_NAME, ttl=TTL):
                    pass
                lat.append(clock() - t0)
            seconds = (clock() - begin) / 1e9
            stats = backend.stats()
            if stats.losses or stats.busy_attempts:
                raise RuntimeError(f"uncontended run saw losses/busy attempts: {stats}")
            return RepResult(seconds, lat)

    return on_loop(main)


T = TypeVar("T")

#: The event loop the runs of this process use (``--loop``; the workers get it in argv).
LOOP = "asyncio"


def on_loop(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    return loops.run(LOOP, func, *args)


def part_a(cycles: int, reps: int, tmp: Path) -> None:
    try:
        aiosqlite: Any = importlib.import_module("aiosqlite")
    except ImportError:
        aiosqlite = None
    variants = [
        Variant("sqlite3 in calling thread (floor)", run_floor),
        Variant("sqlite3 via to_thread.run_sync", run_floor_to_thread, "2 hops/cycle"),
        Variant(
            "aiosqlite",
            None if aiosqlite is None else make_aiosqlite_runner(aiosqlite),
            "not installed" if aiosqlite is None else "4 statements/cycle",
        ),
        Variant("asynclock sqlite://", run_asynclock, "async with backend.lock()"),
    ]
    print(f"\nPart A: uncontended acquire+release, {cycles} cycles x {reps} reps (median)")
    # Interleave variants within each repetition so drift (thermal, page cache, noisy
    # neighbours) hits them all alike; every run gets a fresh file.
    for rep in range(reps):
        for k, variant in enumerate(variants):
            if variant.run is None:
                continue
            path = tmp / f"a-{k}-{rep}.db"
            variant.reps.append(variant.run(path, cycles))
    floor_rate = statistics.median(r.rate for r in variants[0].reps)
    rows: list[list[str]] = []
    for variant in variants:
        if not variant.reps:
            rows.append([variant.label, "-", "-", "-", "-", "", variant.note])
            continue
        rate = statistics.median(r.rate for r in variant.reps)
        p50 = statistics.median(percentile(sorted(r.latencies_ns), 0.50) for r in variant.reps)
        p99 = statistics.median(percentile(sorted(r.latencies_ns), 0.99) for r in variant.reps)
        ratio = rate / floor_rate
        target = ""
        if variant.run is run_asynclock:
            verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
            target = f">= {TARGET_RATIO:.2f}x {verdict}"
        rows.append(
            [
                variant.label,
                f"{rate:,.0f}",
                f"{p50 / 1e3:,.1f}",
                f"{p99 / 1e3:,.1f}",
                f"{ratio:.2f}x",
                target,
                variant.note,
            ]
        )
    print_table(["variant", "cycles/s", "p50 µs", "p99 µs", "x floor", "target", "note"], rows)


# -- Part B: contention between processes -------------------------------------------------


@dataclass
class WorkerResult:
    waits: list[float]
    intervals: list[tuple[float, float]]
    tokens: list[int]
    attempts: int
    pending: float | None  # a wait still unfinished when time ran out
    open_retries: int  # failed opens before the backend opened

    @classmethod
    def from_event(cls, raw: dict[str, Any]) -> WorkerResult:
        return cls(
            waits=[float(w) for w in raw["waits"]],
            intervals=[(float(a), float(b)) for a, b in raw["intervals"]],
            tokens=[int(t) for t in raw["tokens"]],
            attempts=int(raw["attempts"]),
            pending=None if raw["pending"] is None else float(raw["pending"]),
            open_retries=int(raw["open_retries"]),
        )


def hold_busy(seconds: float) -> None:
    """Do 'work' for ``seconds`` without giving up the CPU (same cost for every peer)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def wait_for_start() -> float:
    """Block until the parent sends the common start instant (CLOCK_MONOTONIC)."""
    emit("ready")
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("parent closed the pipe before the start signal")
    return float(line)


async def open_backend(stack: contextlib.AsyncExitStack, url: str) -> tuple[asynclock.Backend, int]:
    """Open a backend, retrying BackendUnavailable a bounded number of times.

    asynclock's SQLite open runs ``PRAGMA journal_mode = WAL`` with no busy retry, so a
    process that opens the file while another is doing the same can fail with
    "database is locked". The retries are counted and printed so the problem stays visible.
    """
    for attempt in range(OPEN_ATTEMPTS):
        backend = asynclock.connect(url)
        try:
            await stack.enter_async_context(backend)
        except asynclock.BackendUnavailable:
            if attempt == OPEN_ATTEMPTS - 1:
                raise
            await anyio.sleep(OPEN_RETRY)
            continue
        return backend, attempt
    raise AssertionError("unreachable")


async def worker_asynclock(db_path: str, seconds: float, hold: float) -> WorkerResult:
    waits: list[float] = []
    intervals: list[tuple[float, float]] = []
    tokens: list[int] = []
    pending: float | None = None
    async with contextlib.AsyncExitStack() as stack:
        backend, open_retries = await open_backend(stack, f"sqlite:///{db_path}")
        async with backend.lock(f"warmup-{os.getpid()}", ttl=TTL):
            pass
        warm = backend.stats()
        start_at = await anyio.to_thread.run_sync(wait_for_start)
        end_at = start_at + seconds
        await anyio.sleep(max(0.0, start_at - time.monotonic()))
        for _ in range(10_000_000):  # bounded; the clock ends it long before
            t0 = time.monotonic()
            if t0 >= end_at:
                break
            try:
                async with backend.lock(LOCK_NAME, ttl=TTL, timeout=end_at - t0) as lease:
                    t1 = time.monotonic()
                    hold_busy(hold)
                    t2 = time.monotonic()
            except asynclock.AcquireTimeout:
                pending = time.monotonic() - t0
                break
            waits.append(t1 - t0)
            intervals.append((t1, t2))
            tokens.append(lease.token)
        stats = backend.stats()
    attempts = (stats.acquired - warm.acquired) + (stats.busy_attempts - warm.busy_attempts)
    return WorkerResult(waits, intervals, tokens, attempts, pending, open_retries)


def worker_naive(db_path: str, seconds: float, hold: float) -> WorkerResult:
    """The peer: a retry loop with a fixed sleep and no queue, as many hand-rolled locks do."""
    waits: list[float] = []
    intervals: list[tuple[float, float]] = []
    attempts = 0
    pending: float | None = None
    owner = f"{os.getpid()}"
    db = open_plain(Path(db_path))
    try:
        start_at = wait_for_start()
        end_at = start_at + seconds
        time.sleep(max(0.0, start_at - time.monotonic()))
        for _ in range(10_000_000):  # bounded; the clock ends it long before
            t0 = time.monotonic()
            if t0 >= end_at:
                break
            acquired = False
            while (now := time.monotonic()) < end_at:
                attempts += 1
                try:
                    db.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    if not is_busy(exc):
                        raise
                    time.sleep(NAIVE_RETRY)
                    continue
                try:
                    now = time.monotonic()
                    row = db.execute(NAIVE_CHECK, (LOCK_NAME,)).fetchone()
                    if row is None or row[0] <= now:
                        db.execute(FLOOR_UPSERT, (LOCK_NAME, owner, 0, now + TTL))
                        acquired = True
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
                if acquired:
                    break
                time.sleep(NAIVE_RETRY)
            if not acquired:
                pending = now - t0
                break
            t1 = time.monotonic()
            hold_busy(hold)
            t2 = time.monotonic()
            waits.append(t1 - t0)
            intervals.append((t1, t2))
            # Release must happen even past end_at; bounded by the lease's own ttl.
            give_up = time.monotonic() + TTL
            while True:
                try:
                    db.execute(FLOOR_DELETE, (LOCK_NAME, owner))
                    break
                except sqlite3.OperationalError as exc:
                    if not is_busy(exc) or time.monotonic() >= give_up:
                        raise
                    time.sleep(NAIVE_RETRY)
    finally:
        db.close()
    return WorkerResult(waits, intervals, [], attempts, pending, 0)


def worker_main(mode: str, db_path: str, seconds: float, hold: float) -> None:
    if mode == "asynclock":
        result = on_loop(worker_asynclock, db_path, seconds, hold)
    elif mode == "naive":
        result = worker_naive(db_path, seconds, hold)
    else:
        raise SystemExit(f"unknown worker mode {mode!r}")
    emit("result", **asdict(result))


async def run_contention(
    mode: str, db_path: Path, seconds: float, hold: float, processes: int
) -> list[WorkerResult]:
    """Start ``processes`` workers, release them at one instant, collect their results."""
    async with WorkerGroup() as group:
        argv = [
            "-m",
            "benchmarks.bench_sqlite",
            "--worker",
            mode,
            *map(str, (db_path, seconds, hold)),
            LOOP,
        ]
        workers = [await group.start(argv, label=f"{mode} worker {i}") for i in range(processes)]
        for worker in workers:
            await worker.expect("ready", 60)  # start-up: imports, open, schema
        start_at = time.monotonic() + 0.05
        for worker in workers:
            await worker.send(repr(start_at))
        results = []
        for worker in workers:
            event = await worker.expect("result", seconds + 60)
            results.append(WorkerResult.from_event(event))
            code = await worker.wait(60)
            if code != 0:
                raise RuntimeError(f"{worker.label} exited with {code}")
        return results


def holds(results: Sequence[WorkerResult]) -> list[Hold]:
    """Every process's holds, for the history checker (tokens where the peer has them)."""
    return [
        Hold(str(p), a, b, r.tokens[i] if r.tokens else None)
        for p, r in enumerate(results)
        for i, (a, b) in enumerate(r.intervals)
    ]


def count_overlaps(results: Sequence[WorkerResult]) -> int:
    """Holds that start before another process's earlier hold has ended (0 = exclusion held)."""
    return len(overlaps(holds(results)))


def handoff_gaps(results: Sequence[WorkerResult]) -> list[float]:
    """Sorted idle times between one hold's end and the next hold's start (any process)."""
    spans = sorted(span for r in results for span in r.intervals)
    return sorted(b[0] - a[1] for a, b in itertools.pairwise(spans))


def tokens_increase(results: Sequence[WorkerResult]) -> bool:
    return not tokens_out_of_order(holds(results))


def part_b(seconds: float, hold: float, tmp: Path) -> None:
    print(
        f"\nPart B: {PROCESSES} processes contend on one name, hold {hold * 1e3:g} ms "
        f"(busy-wait), {seconds:g} s after a common start"
    )
    runs = [
        ("asynclock", "asynclock sqlite://"),
        ("naive", f"naive retry ({NAIVE_RETRY * 1e3:g} ms sleep)"),
    ]
    rows: list[list[str]] = []
    summaries: list[list[str]] = []
    checks: list[str] = []
    for mode, label in runs:
        db_path = tmp / f"b-{mode}.db"
        # Create the file (WAL mode, schema) before the race so every worker opens an
        # initialised database; the start-up race is not what this measures.
        if mode == "asynclock":

            async def init(path: Path = db_path) -> None:
                async with asynclock.connect(f"sqlite:///{path}"):
                    pass

            on_loop(init)
        else:
            open_plain(db_path).close()
        results = on_loop(run_contention, mode, db_path, seconds, hold, PROCESSES)
        counts = [len(r.waits) for r in results]
        for i, r in enumerate(results):
            waits = sorted(r.waits)
            worst = max([*waits, r.pending or 0.0])
            rows.append(
                [
                    label if i == 0 else "",
                    str(i),
                    str(len(waits)),
                    f"{r.attempts / max(1, len(waits)):.1f}",
                    f"{percentile(waits, 0.50) * 1e3:.2f}",
                    f"{percentile(waits, 0.99) * 1e3:.2f}",
                    f"{worst * 1e3:.2f}" + ("*" if r.pending and r.pending >= worst else ""),
                ]
            )
        overlaps = count_overlaps(results)
        tokens = "n/a"
        if mode == "asynclock":
            tokens = "yes" if tokens_increase(results) else "NO"
        gaps = handoff_gaps(results)
        checks.append(
            f"  {label}: overlaps: {overlaps} ({sum(counts)} holds checked); "
            f"open retries: {sum(r.open_retries for r in results)}"
        )
        summaries.append(
            [
                label,
                f"{sum(counts) / seconds:,.0f}",
                f"{percentile(gaps, 0.50) * 1e3:.2f}",
                f"{percentile(gaps, 0.99) * 1e3:.2f}",
                f"{min(counts) / max(1, max(counts)):.2f}",
                f"{min(counts)}/{max(counts)}",
                str(overlaps),
                tokens,
            ]
        )
    print_table(
        [
            "peer",
            "proc",
            "acquisitions",
            "attempts/acq",
            "p50 wait ms",
            "p99 wait ms",
            "max wait ms",
        ],
        rows,
    )
    print("  (* = the longest wait was still unfinished when time ran out)")
    print()
    print("  gap = idle time between one hold's end and the next hold's start")
    print_table(
        [
            "peer",
            "total acq/s",
            "gap p50 ms",
            "gap p99 ms",
            "fairness",
            "min/max acq",
            "overlaps",
            "tokens increase",
        ],
        summaries,
    )
    for line in checks:
        print(line)


# -- entry point ---------------------------------------------------------------------------


def asynclock_revision() -> str:
    """The git commit of the asynclock being measured (+ "dirty" if asynclock/ has edits)."""
    repo = Path(asynclock.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "asynclock"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"
    return f"commit {head}{' + uncommitted asynclock/ edits' if dirty else ''}"


def machine_note() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{platform.system()} {platform.machine()}, {cores} cores, Python "
        f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"anyio asyncio backend, load average {os.getloadavg()[0]:.2f} at start"
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cycles", type=int, default=3000, help="cycles per repetition (A)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions, median reported (A)")
    parser.add_argument("--seconds", type=float, default=5.0, help="contention duration (B)")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--skip-a", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-b", action="store_true", help=argparse.SUPPRESS)
    loops.add_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.reps, args.seconds = 300, 3, 1.0
    if args.cycles < 1 or args.reps < 3 or not (0 < args.seconds <= 3600):
        parser.error("need --cycles >= 1, --reps >= 3 (a median) and --seconds in (0, 3600]")
    return args


def main(argv: Sequence[str]) -> None:
    global LOOP
    if argv[:1] == ["--worker"]:
        mode, db_path, seconds, hold, LOOP = argv[1:6]
        worker_main(mode, db_path, float(seconds), float(hold))
        return
    args = parse_args(argv)
    print(
        f"asynclock {asynclock.__version__} ({asynclock_revision()}) SQLite benchmark\n"
        f"{machine_note()}"
    )
    for LOOP in loops.chosen(args):
        loops.heading(LOOP)
        with tempfile.TemporaryDirectory(prefix="asynclock-bench-") as tmp:
            if not args.skip_a:
                part_a(args.cycles, args.reps, Path(tmp))
            if not args.skip_b:
                part_b(args.seconds, HOLD, Path(tmp))


if __name__ == "__main__":
    main(sys.argv[1:])
