"""The ZooKeeper backend against the raw floor and kazoo's Lock (issue 27).

Run: ``uv run python -m benchmarks.bench_zookeeper [--cycles 500] [--reps 3] [--rounds 200]``
(or as a script). Starts its own one-node ZooKeeper (Debian's jars, as the tests do) on
loopback ports and prints:

1. uncontended acquire+release cycles/s (median of ``--reps``) as a ratio to the floor: the
   same client (kazoo through asynclock's bridge) creating an ephemeral sequential node and
   deleting it; beside it kazoo's blocking create+delete, and the peer, kazoo's ``Lock``
   (acquire+release, blocking, in a thread);
2. handoff: one backend holds, another (its own session, like another process) waits; time
   from the start of the release to the waiter holding, p50/p99.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread

import asynclock
from asynclock.backends.zookeeper import ZooKeeperDriver


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


async def rate(cycle: Callable[[], Awaitable[None]], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        await cycle()
    return n / (time.perf_counter() - started)


def sync_rate(cycle: Callable[[], object], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        cycle()
    return n / (time.perf_counter() - started)


async def uncontended(url: str, hosts: str, cycles: int, reps: int) -> None:
    from kazoo.client import KazooClient

    results: dict[str, list[float]] = {"floor": [], "kazoo-sync": [], "asynclock": [], "lock": []}
    client = KazooClient(hosts=hosts)
    await anyio.to_thread.run_sync(lambda: client.start(timeout=15))
    client.ensure_path("/bench-floor")
    kazoo_lock = client.Lock("/bench-kazoo-lock", "bench")

    def kazoo_create_delete() -> None:
        path = client.create("/bench-floor/n", b"", ephemeral=True, sequence=True)
        client.delete(path)

    def kazoo_lock_cycle() -> None:
        kazoo_lock.acquire()
        kazoo_lock.release()

    async with asynclock.connect(url) as backend:
        driver = backend.driver
        assert isinstance(driver, ZooKeeperDriver)
        zk = driver.zk
        await zk.ensure_path("/bench-floor")

        async def floor() -> None:
            path, _ = await zk.created(zk.create_ephemeral_sequential("/bench-floor/a", b""))
            await zk.delete(path)

        async def ours() -> None:
            async with backend.lock("bench-asynclock", ttl=10.0):
                pass

        await rate(floor, 20)
        await rate(ours, 20)
        for _ in range(reps):
            results["floor"].append(await rate(floor, cycles))
            results["asynclock"].append(await rate(ours, cycles))
            results["kazoo-sync"].append(
                await anyio.to_thread.run_sync(sync_rate, kazoo_create_delete, cycles)
            )
            results["lock"].append(
                await anyio.to_thread.run_sync(sync_rate, kazoo_lock_cycle, cycles)
            )
    await anyio.to_thread.run_sync(client.stop)
    client.close()
    base = statistics.median(results["floor"])
    labels = {
        "floor": "bridge: create ephemeral sequential + delete (floor)",
        "kazoo-sync": "kazoo blocking create + delete",
        "asynclock": "asynclock zookeeper:// lock()",
        "lock": "kazoo Lock acquire+release (peer)",
    }
    rows = []
    for key, label in labels.items():
        median = statistics.median(results[key])
        note = ""
        if key == "asynclock":
            peer = statistics.median(results["lock"])
            note = "target >= 0.80x floor " + ("met" if median >= 0.8 * base else "MISSED")
            note += ", ahead of kazoo Lock" if median > peer else ", BEHIND kazoo Lock"
        rows.append(
            [label, f"{median:,.0f}", f"{1000 / median:.2f}", f"{median / base:.2f}x", note]
        )
    table(
        f"1. uncontended acquire+release, {cycles} cycles x {reps} reps (median)",
        ["variant", "cycles/s", "ms/cycle", "x floor", "note"],
        rows,
    )


async def handoff(url: str, rounds: int) -> None:
    gaps: list[float] = []
    async with asynclock.connect(url) as a, asynclock.connect(url) as b:
        driver = b.driver
        assert isinstance(driver, ZooKeeperDriver)

        async def waiter(got: anyio.Event, at: list[float]) -> None:
            async with b.lock("bench-handoff", ttl=10.0, timeout=10):
                at.append(time.perf_counter())
                got.set()

        async def queued() -> None:  # the waiter's node is behind the holder's
            while True:
                if driver.waiting:
                    return
                await anyio.sleep(0.001)

        for _ in range(rounds):
            held = await a.acquire("bench-handoff", ttl=10.0)
            got, at = anyio.Event(), list[float]()
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter, got, at)
                await queued()
                started = time.perf_counter()
                await held.release()
                await got.wait()
            gaps.append((at[0] - started) * 1000)
    gaps.sort()
    p50 = statistics.median(gaps)
    p99 = gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]
    table(
        f"2. handoff to a waiter (another session), {rounds} rounds",
        ["p50 ms", "p99 ms", "note"],
        [[f"{p50:.2f}", f"{p99:.2f}", "target p50 <= 2 ms " + ("met" if p50 <= 2 else "MISSED")]],
    )


async def main(args: argparse.Namespace) -> None:
    from tests.support.zk_servers import ZkEnsemble

    with tempfile.TemporaryDirectory() as tmp:
        ensemble = ZkEnsemble(Path(tmp), 1)
        await anyio.to_thread.run_sync(ensemble.start)
        try:
            await uncontended(ensemble.url, ensemble.hosts, args.cycles, args.reps)
            await handoff(ensemble.url, args.rounds)
        finally:
            ensemble.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    anyio.run(main, parser.parse_args())
