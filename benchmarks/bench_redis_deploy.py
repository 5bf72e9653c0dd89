"""Redis as people deploy it (issue 41): Sentinel and Cluster against one server and
against redis-py's ``Lock`` on the same deployment.

Run: ``uv run --group bench python -m benchmarks.bench_redis_deploy [--reps 3]``. Starts
its own servers on loopback ports: one redis-server; a primary with 2 replicas behind 3
sentinels; a Redis Cluster of 3 primaries with a replica each (no persistence, diskless
sync). Prints two tables:

1. uncontended acquire+release cycles/s (median of ``--reps`` runs of ``--seconds``), and
   the ratio to asynclock on the lone server: asynclock and redis-py's asyncio ``Lock`` on
   each deployment; on Sentinel also with ``wait_replicas=1`` (asynclock: ``WAIT 1`` after
   the grant, on the grant's connection) and redis-py's ``Lock`` followed by ``WAIT 1``;
   redis-py's Lock on a cluster is ``RedisCluster.lock``;
2. 1,000 leases held ``--hold`` s at ttl 2 s: renewal scripts per primary per renewal
   interval (``INFO commandstats``), on the cluster with the leases spread over its slots
   (one script per node per round is the target), CPU of this process, leases lost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel

from asynclock._harness.redis_deploy import ClusterDeployment, SentinelDeployment
from asynclock._harness.servers import RedisServer
from benchmarks import bench_redis
from benchmarks.bench_redis import STACK, cycles_per_second, many_leases

Cycle = Callable[[], Awaitable[None]]


def asynclock_cycle(url: str) -> Awaitable[Cycle]:
    """bench_redis's asynclock cycle (one name, ttl 10 s) on ``url``."""
    return bench_redis.asynclock_cycle(lambda _servers: url)([])


async def redis_py_cycle(client: Any, wait: bool = False) -> Cycle:
    STACK.append(client.aclose)
    lock = client.lock("redis-py", timeout=10)

    async def cycle() -> None:
        await lock.acquire()
        if wait:  # what wait_replicas=1 buys, done by hand on the lock's client
            await client.execute_command("WAIT", 1, 1000)
        await lock.release()

    return cycle


async def per_second(make: Callable[[], Awaitable[Cycle]], seconds: float) -> float:
    """bench_redis's measurement (warm-up, then cycles for ``seconds``) of one cycle."""
    return await cycles_per_second(lambda _servers: make(), [], seconds)


async def uncontended(
    lone: RedisServer, sentinel: SentinelDeployment, cluster: ClusterDeployment, args: Any
) -> None:
    def sentinel_client() -> Any:
        hosts = [("127.0.0.1", p) for p in sentinel.sentinel_ports]
        sentinels = redis.asyncio.sentinel.Sentinel(hosts)  # type: ignore[no-untyped-call]
        return sentinels.master_for(sentinel.service)

    def cluster_client() -> Any:
        node = cluster.primary_nodes()[0]
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=node.port)

    rows: list[tuple[str, Callable[[], Awaitable[Cycle]]]] = [
        ("asynclock redis:// (one server)", lambda: asynclock_cycle(lone.url)),
        ("redis-py Lock, one server", lambda: redis_py_cycle(redis.asyncio.Redis(port=lone.port))),
        ("asynclock redis+sentinel://", lambda: asynclock_cycle(sentinel.url)),
        ("redis-py Lock via Sentinel", lambda: redis_py_cycle(sentinel_client())),
        (
            "asynclock redis+sentinel:// wait_replicas=1",
            lambda: asynclock_cycle(sentinel.url + "?wait_replicas=1"),
        ),
        ("redis-py Lock via Sentinel + WAIT 1", lambda: redis_py_cycle(sentinel_client(), True)),
        ("asynclock redis+cluster://", lambda: asynclock_cycle(cluster.url)),
        ("redis-py Lock on RedisCluster", lambda: redis_py_cycle(cluster_client())),
    ]
    print(f"\n## uncontended acquire+release, cycles/s (median of {args.reps})\n")
    print("| library, deployment | cycles/s | x asynclock on one server |")
    print("|---|---|---|")
    base = None
    for label, make in rows:
        rate = statistics.median([await per_second(make, args.seconds) for _ in range(args.reps)])
        base = base or rate
        print(f"| {label} | {rate:,.0f} | {rate / base:.2f} |", flush=True)


async def renewals(
    lone: RedisServer, sentinel: SentinelDeployment, cluster: ClusterDeployment, args: Any
) -> None:
    print(f"\n## 1,000 leases held {args.hold:g} s at ttl 2 s\n")
    print("| deployment | primaries | renewal scripts per primary per interval | CPU % | lost |")
    print("|---|---|---|---|---|")
    cases = [
        ("redis:// (one server)", lone.url, [lone]),
        ("redis+sentinel://", sentinel.url, [sentinel.primary()]),
        ("redis+cluster://", cluster.url, cluster.primary_nodes()),
    ]
    for label, url, servers in cases:
        # bench_redis's measurement: the median over the primaries, per renewal interval.
        r = await many_leases(servers, url, args.hold)
        print(
            f"| {label} | {len(servers)} | {r['commands_per_node_per_interval']:.2f} | "
            f"{r['cpu_percent']:.1f} | {r['lost']:.0f} |",
            flush=True,
        )


async def run(args: argparse.Namespace, root: Path) -> None:
    lone = RedisServer(root / "lone").start()
    sentinel = SentinelDeployment(root / "sentinel", replicas=2)
    cluster = ClusterDeployment(root / "cluster")
    try:
        sentinel.start()
        cluster.start()
        version = redis.Redis(port=lone.port).info()["redis_version"]
        print(f"redis-server {version}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
        if "uncontended" not in args.skip:
            await uncontended(lone, sentinel, cluster, args)
        if "leases" not in args.skip:
            await renewals(lone, sentinel, cluster, args)
    finally:
        cluster.stop()
        sentinel.stop()
        lone.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="per uncontended run")
    parser.add_argument("--hold", type=float, default=6.0, help="many-leases hold time")
    parser.add_argument("--skip", default="", help="comma list of: uncontended,leases")
    args = parser.parse_args()
    args.skip = set(args.skip.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(run, args, Path(tmp))


if __name__ == "__main__":
    main()
