"""PostgreSQL backend benchmark: uncontended acquire + release cycles per second.

Rows, side by side in one run against one server:

* floor: raw asyncpg on one connection, ``SELECT pg_try_advisory_lock($1)`` then
  ``SELECT pg_advisory_unlock($1)`` (no token, no loss detection);
* asynclock ``postgresql://`` (session advisory lock + token from the shared unlogged
  sequence + token lock in one statement, no WAL; release NOTIFYs only if a waiter
  announced itself):
  ``async with backend.lock(name, ttl=10): pass``;
* asynclock ``postgresql://...?mode=lease`` (lease-table upsert + owner-checked delete);
* tooz's PostgreSQL driver (psycopg2; a new connection per acquire, 16-bit keys, no
  token), if ``tooz`` and ``psycopg2`` import (``uv run --group bench --with
  psycopg2-binary``).

Each row is the median of ``--reps`` runs of ``--cycles`` cycles (tooz: a tenth as many).
By default the script starts a throwaway PostgreSQL on a free loopback port with the
server's durable defaults (``fsync=on``, ``synchronous_commit=on``, as in production: a
mode=lease acquire is a WAL flush; a mode=session acquire writes no WAL);
``--fast`` turns durability off, ``--url`` uses your server.

Usage (as a module, or as a script: ``python benchmarks/bench_postgres.py``)::

    uv run --group bench --with psycopg2-binary python -m benchmarks.bench_postgres \\
        [--cycles N] [--reps R] [--fast | --url postgresql://...]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import asyncpg  # type: ignore[import-untyped]

import asynclock
from asynclock._core.driver import Busy
from asynclock.backends.postgres import lock_key
from benchmarks import _loops as loops

TTL = 10.0
TARGETS = {"asynclock mode=session": 0.85, "asynclock mode=lease": 0.7}


async def floor(url: str, cycles: int) -> float:
    conn = await asyncpg.connect(url)
    key = lock_key(f"floor:{uuid.uuid4()}")
    try:
        start = time.perf_counter()
        for _ in range(cycles):
            assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", key)
            await conn.fetchval("SELECT pg_advisory_unlock($1)", key)
        return cycles / (time.perf_counter() - start)
    finally:
        await conn.close()


def ours(query: str) -> Callable[[str, int], Awaitable[float]]:
    async def run(url: str, cycles: int) -> float:
        name = f"bench:{uuid.uuid4()}"
        async with asynclock.connect(url + query) as backend:
            lock = backend.lock(name, ttl=TTL)
            async with lock:  # warm: schema check, prepared statements
                pass
            start = time.perf_counter()
            for _ in range(cycles):
                async with lock:
                    pass
            return cycles / (time.perf_counter() - start)

    return run


async def driver_only(url: str, cycles: int) -> float:
    """The session-mode driver's two statements without the core (for attribution)."""
    backend = asynclock.connect(url)
    driver = backend.driver
    await driver.open()
    try:
        name = f"driver:{uuid.uuid4()}"
        start = time.perf_counter()
        for _ in range(cycles):
            assert not isinstance(await driver.acquire(name, "o", TTL, queue=False), Busy)
            await driver.release(name, "o", None)
        return cycles / (time.perf_counter() - start)
    finally:
        await driver.aclose()


async def tooz_peer(url: str, cycles: int) -> float:
    from tooz import coordination

    def run() -> float:
        coordinator = coordination.get_coordinator(url, b"bench-member")
        coordinator.start()
        try:
            lock = coordinator.get_lock(f"tooz:{uuid.uuid4()}".encode())
            start = time.perf_counter()
            for _ in range(cycles):
                assert lock.acquire(blocking=False)
                lock.release()
            return cycles / (time.perf_counter() - start)
        finally:
            coordinator.stop()

    return await anyio.to_thread.run_sync(run)


@contextlib.contextmanager
def throwaway_server(durable: bool) -> Iterator[str]:
    from tests.support.pg_servers import PgServer, _own, find_pg_bin, free_port

    root = Path(tempfile.mkdtemp(prefix="asynclock-bench-pg-"))
    _own(root)
    server = PgServer(find_pg_bin(), root, free_port())
    try:
        server.init(durable=durable)
        server.start()
        server.psql_setup()
        yield server.url()
    finally:
        with contextlib.suppress(Exception):
            server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


async def bench(url: str, cycles: int, reps: int) -> None:
    rows: list[tuple[str, Callable[[str, int], Awaitable[float]], int]] = [
        ("floor: asyncpg try_lock + unlock", floor, cycles),
        ("asynclock mode=session", ours(""), cycles),
        ("  its driver alone (no core)", driver_only, cycles),
        ("asynclock mode=lease", ours("?mode=lease"), cycles),
        ("tooz pgsql driver", tooz_peer, max(cycles // 10, 50)),
    ]
    runs: dict[str, list[float]] = {}
    skipped: dict[str, str] = {}
    for _ in range(reps):  # interleave the rows so drift in the machine hits all alike
        for label, fn, n in rows:
            if label in skipped:
                continue
            try:
                rate = await fn(url, n)
            except ImportError as exc:
                skipped[label] = f"skipped: {exc} (uv run --group bench --with psycopg2-binary)"
                continue
            runs.setdefault(label, []).append(rate)
    medians = {label: statistics.median(r) for label, r in runs.items()}
    base = medians["floor: asyncpg try_lock + unlock"]
    print(f"\nPostgreSQL acquire+release, {cycles} cycles x {reps} reps (median), one process")
    print(f"{'':36} {'cycles/s':>10} {'x floor':>8}  target")
    for label, _, _ in rows:
        if label in skipped:
            print(f"{label:36} {skipped[label]}")
            continue
        ratio = medians[label] / base
        target = TARGETS.get(label)
        verdict = (
            "" if target is None else f">= {target:.2f} {'met' if ratio >= target else 'MISSED'}"
        )
        print(f"{label:36} {medians[label]:10.0f} {ratio:8.2f}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--url", help="use this server instead of starting one")
    group.add_argument("--fast", action="store_true", help="throwaway server with fsync off")
    loops.add_option(parser)
    args = parser.parse_args()
    print(f"Python {platform.python_version()}, asyncpg {asyncpg.__version__}")
    with contextlib.ExitStack() as stack:
        url = args.url
        if not url:
            url = stack.enter_context(throwaway_server(durable=not args.fast))
            print(f"throwaway server, durable={not args.fast}")
        for loop in loops.chosen(args):
            loops.heading(loop)
            loops.run(loop, bench, url, args.cycles, args.reps)


if __name__ == "__main__":
    main()
