"""Many holds at once (issue 45): how the cost of holding grows with the number of leases.

One process takes N names with ``lock(name, ttl=TTL)`` (N tasks, each in its own
``async with``), holds them for three renewal intervals, then every block exits at once
(a mass release, as at shutdown). Per backend and N it prints:

* acquire — seconds until all N are held;
* CPU/lease/renewal — the process's CPU while only holding, per lease renewed;
* CPU % — of one core while only holding;
* rt p99 — the renewal round trip's 99th percentile (one round may be several calls),
  against the budget: the time between a lease's renewal and its local deadline;
* renewal calls/interval — driver calls per renewal interval (O(1) on etcd and ZooKeeper);
* lost — leases lost while healthy (must be 0);
* RSS — resident memory once all are held;
* release — seconds for the mass release, and release failures.

Then W waiters on one name (``--waiters``, in one process or ``--procs`` processes): the
hand-off latency p50/p99 (one holder's exit to the next one's entry), the server's work and
the clients' CPU per hand-off, over the first ``--handoffs`` hand-offs (see
``benchmarks/_waiters.py``); flat rows as W grows mean no herd.

The anchor: Redisson's watchdog renews every lock of a client from one timer every
``lockWatchdogTimeout / 3`` (10 s of a 30 s lease), ``lockWatchdogBatchSize`` (100) locks
per Lua call, grouped by cluster slot (``org.redisson.renewal``).

Usage::

    uv run python -m benchmarks.bench_scale [--backend redis,postgres-lease,...]
        [--n 1000,10000] [--ttl 6] [--waiters 10,1000,10000] [--procs 1,10]
        [--handoffs 10000] [--loop asyncio]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

import asynclock
from asynclock._core.observer import Observer
from benchmarks import _loops as loops
from benchmarks import _waiters

BACKENDS = ("memory", "sqlite", "redis", "postgres-lease", "postgres", "etcd", "zookeeper")


@contextlib.contextmanager
def server(kind: str, tmp: Path) -> Iterator[tuple[str, int | None]]:
    """A fresh server for ``kind`` (the docs' defaults): its URL, and ZooKeeper's client
    port (for the four-letter word that counts its packets; None elsewhere)."""
    from asynclock._harness import servers

    if kind == "memory":
        yield "memory://", None
    elif kind == "sqlite":
        yield f"sqlite:///{tmp / 'locks.db'}", None
    elif kind == "redis":
        redis = servers.RedisServer(tmp / "redis").start()
        try:
            yield redis.url, None
        finally:
            redis.stop()
    elif kind in ("postgres", "postgres-lease"):
        from asynclock._harness.pg_server import running_pg

        with running_pg("asynclock-bench-scale-") as pg:
            yield pg.url() + ("?mode=lease" if kind == "postgres-lease" else ""), None
    elif kind == "etcd":
        cluster = servers.EtcdServers(tmp / "etcd", 1).start()
        try:
            yield cluster.url, None
        finally:
            cluster.stop()
    elif kind == "zookeeper":
        from asynclock._harness.zookeeper import ZookeeperServers

        # The tests' 128 MB heap runs out (OutOfMemoryError) near 100,000 nodes and watches.
        ensemble = ZookeeperServers(tmp / "zk", 1, heap="1g").start()
        try:
            yield ensemble.url, ensemble.members[0].client_port
        finally:
            ensemble.stop()
    else:
        raise SystemExit(f"unknown backend {kind!r}: one of {', '.join(BACKENDS)}")


class Rounds(Observer):
    """Renewal round trips, and how many leases each round renewed."""

    def __init__(self) -> None:
        self.trips: list[float] = []
        self.leases = 0

    def renewal_timing(self, round_trip: float, lag: float, leases: list[Any]) -> None:
        self.trips.append(round_trip)
        self.leases += len(leases)


class Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def hold_many(url: str, n: int, ttl: float, concurrency: int) -> dict[str, Any]:
    warnings = Counting()
    logging.getLogger("asynclock").addHandler(warnings)
    rounds = Rounds()
    calls = {"extend": 0}
    async with asynclock.connect(url) as backend:
        driver = backend.driver
        real_extend = driver.extend

        async def counted(refs: Any) -> Any:
            calls["extend"] += 1
            return await real_extend(refs)

        driver.extend = counted  # type: ignore[method-assign,assignment]
        backend.add_observer(rounds)
        held = anyio.Event()
        go = anyio.Event()
        count = [0, 0, 0]  # held, lost, failed to acquire
        errors: dict[str, int] = {}

        gate = anyio.Semaphore(concurrency or n)

        async def one(i: int) -> None:
            try:
                await gate.acquire()
                async with backend.lock(f"scale:{i}", ttl=ttl):
                    gate.release()
                    count[0] += 1
                    if count[0] + count[2] == n:  # every one held or failed
                        held.set()
                    await go.wait()
            except asynclock.LeaseLost:
                count[1] += 1
            except Exception as exc:
                gate.release()
                count[2] += 1
                errors.setdefault(type(exc).__name__ + ": " + str(exc)[:120], 0)
                errors[type(exc).__name__ + ": " + str(exc)[:120]] += 1
                if count[0] + count[2] == n:
                    held.set()

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            with anyio.move_on_after(600):
                await held.wait()
            acquired = time.perf_counter() - started
            rss = rss_mb()
            stats0 = backend.stats()
            calls0, trips0 = calls["extend"], len(rounds.trips)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await anyio.sleep(ttl)  # three renewal intervals (heartbeat ttl/3)
            cpu = time.process_time() - cpu0
            wall = time.perf_counter() - wall0
            stats1 = backend.stats()
            trips1 = len(rounds.trips)
            renewed = stats1.renewals - stats0.renewals
            warns_before = warnings.lines
            t_release = time.perf_counter()
            go.set()
        released = time.perf_counter() - t_release
        # While holding only (a round sent during the mass release may wait behind it).
        trips = rounds.trips[trips0:trips1]
        lost = backend.stats().losses
        if lost:
            print(
                f"  (lost: {stats1.losses - stats0.losses} while holding, "
                f"{lost - stats1.losses} while releasing; {backend.stats().loss_reasons})",
                file=sys.stderr,
            )
    for text, times in sorted(errors.items(), key=lambda e: -e[1])[:3]:
        print(f"  ({times} x {text})", file=sys.stderr)
    logging.getLogger("asynclock").removeHandler(warnings)
    budget = ttl * (1 - 0.01) - ttl / 3 - 0.005
    return {
        "n": n,
        "acquire_s": acquired,
        "failed": count[2],
        "cpu_us_per_lease_renewal": 1e6 * cpu / renewed if renewed else float("nan"),
        "cpu_pct": 100 * cpu / wall,
        "rt_p99_ms": 1000
        * (
            # (inclusive: with the few rounds of three intervals, the default method
            # extrapolates past the slowest one)
            statistics.quantiles(trips, n=100, method="inclusive")[98]
            if len(trips) > 1
            else (trips[0] if trips else float("nan"))
        ),
        "budget_s": budget,
        "calls_per_interval": (calls["extend"] - calls0) / 3,
        "lost": lost,
        "rss_mb": rss,
        "release_s": released,
        "release_warnings": warnings.lines - warns_before,
    }


async def run_backend(kind: str, url: str, ns: list[int], ttl: float, concurrency: int) -> None:
    # (The server is started outside the event loop: PostgreSQL's set-up runs one.)
    for n in ns:
        r = await hold_many(url, n, ttl, concurrency)
        cells = [
            kind,
            f"{n:,}",
            f"{r['acquire_s']:.1f} s",
            f"{r['cpu_us_per_lease_renewal']:.1f} µs",
            f"{r['cpu_pct']:.1f} %",
            f"{r['rt_p99_ms']:.0f} ms / {r['budget_s']:.1f} s",
            f"{r['calls_per_interval']:.1f}",
            f"**{r['lost']:,}** (+{r['failed']} not acquired)",
            f"{r['rss_mb']:.0f} MB",
            f"{r['release_s']:.2f} s ({r['release_warnings']} warnings)",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


async def run_waiters(
    kind: str,
    url: str,
    zk_port: int | None,
    ws: list[int],
    procs: list[int],
    handoffs: int,
    ttl: float,
) -> None:
    for p in procs:
        for w in ws:
            h = min(w, handoffs)
            if p == 1:
                r = await _waiters.in_one_process(kind, url, w, h, ttl, zk_port)
            else:
                r = await _waiters.in_processes(kind, url, w, h, ttl, zk_port, p)
            work = "-" if r["work"] is None else f"{r['work']:.1f} {_waiters.WORK[kind]}"
            cells = [
                kind,
                f"{w:,}" + (f" ({p} x {w // p:,})" if p > 1 else ""),
                f"{r['handoffs']:,}",
                f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f} ms",
                work,
                f"{r['cpu_us']:.0f} µs",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="redis,postgres-lease,etcd,zookeeper")
    parser.add_argument("--n", default="1000,10000")
    parser.add_argument("--waiters", default="10,1000,10000")
    parser.add_argument(
        "--procs",
        default="1,10",
        help="waiting processes, one row set each: 1 (W tasks in this process) or P "
        "(P child processes of W/P tasks each)",
    )
    parser.add_argument(
        "--handoffs",
        type=int,
        default=10_000,
        help="hand-offs measured per row, at most (the rest of the W are then cancelled)",
    )
    parser.add_argument("--ttl", type=float, default=6.0)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="at most this many acquisitions in flight at once (0: all N at once)",
    )
    loops.add_option(parser)
    args = parser.parse_args()
    ns = [int(x) for x in args.n.split(",") if x]
    ws = [int(x) for x in args.waiters.split(",") if x and int(x) > 0]  # 0: none
    procs = [int(x) for x in args.procs.split(",") if x]
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    kinds = args.backend.split(",")
    for loop in loops.chosen(args):
        loops.heading(loop)
        if ns:
            print(
                "| backend | N held | acquire | CPU/lease/renewal | CPU while holding"
                " | rt p99 / budget | renewal calls/interval | lost | RSS | mass release |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for kind in kinds:
                with tempfile.TemporaryDirectory() as tmp, server(kind, Path(tmp)) as (url, _):
                    loops.run(loop, run_backend, kind, url, ns, args.ttl, args.concurrency)
        if ws:
            print(
                f"\nW waiters on one name, the first min(W, {args.handoffs:,}) hand-offs measured"
                " (then the rest cancelled at once)\n"
            )
            print(
                "| backend | W waiting | hand-offs | hand-off p50 / p99 | server work per"
                " hand-off | client CPU per hand-off |"
            )
            print("|---|---:|---:|---:|---:|---:|")
            for kind in kinds:
                with tempfile.TemporaryDirectory() as tmp, server(kind, Path(tmp)) as served:
                    url, zk_port = served
                    loops.run(
                        loop, run_waiters, kind, url, zk_port, ws, procs, args.handoffs, args.ttl
                    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
