# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""Celery benchmark: no-op task throughput and loss -> LeaseLost latency, real workers.

Part A - throughput: one ``celery worker`` (prefork, concurrency 2, Redis broker and
result backend) runs N no-op tasks with distinct arguments (so no two runs contend for a
lock), in one run side by side:

* plain: ``@app.task``;
* LockedTask: ``base=LockedTask, lock="bench:{i}"`` (a Redis lock held for the execution);
* floor: a plain task that makes the two round trips a lock needs itself, with a
  synchronous redis-py client in the child (``SET NX PX``, then ``DEL``): no background
  thread, no renewal, no owner check, no fencing token. What a lock held for the execution
  cannot go below on one worker (the fair comparison);
* floor + token, owner: the same two round trips as scripts that also keep what makes a
  lock honest at the server: a token from a per-name counter (``INCR``, then ``SET NX PX``)
  and an owner-checked release (``GET`` = owner:token, then ``DEL``). What LockedTask cannot
  go below without dropping a guarantee (it adds the restart grace, the fair queue's
  checks, renewal and the watch on the lease);
* ablation, lock calls in one hop: a plain task that takes and releases an asynclock
  Redis lease in one coroutine on an event-loop thread of its own (one hop, no guard,
  nothing watching the lease while a body runs): the cost of the core's acquire and
  release as an integration on a loop thread sees them, without LockedTask's second hop;
* celery-singleton (``base=Singleton``) and celery-once (``base=QueueOnce``), if they
  import: both lock at *enqueue* time, in the sending process, and delete the key after.

The tasks are queued while the worker is stopped (SIGSTOP), then timed from SIGCONT to the
last result's ``date_done`` ("worker": the peers' enqueue-time locking is not in it, their
unlock in the worker is), and from the first ``apply_async`` ("send+run": the peers' locking
is in it). Each variant runs ``--reps`` times, in a rotating order; medians are shown.
Alongside, the CPU time the worker's processes (the parent and its children, every thread)
and the Redis server spent per task: it depends far less than the rates on what else
runs on the machine.

Part B - loss latency, prefork and solo: a LockedTask body marks its own lease lost
(``asynclock_celery.testing.force_loss``) and then sleeps; the time until ``LeaseLost`` is
raised in the body (heartbeat thread -> SIGUSR2 -> handler) is recorded, and the p50 / p99
are shown.

Usage::

    uv run python -m benchmarks.bench_celery [--tasks N] [--reps R] [--samples S] [--quick]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

import asynclock
from asynclock_celery import LockedTask
from asynclock_celery.testing import force_loss
from benchmarks import _loops
from tests.support.redis_servers import RedisFactory

ROOT = Path(__file__).resolve().parents[1]
BROKER = os.environ.get("BENCH_BROKER", "memory://")
RESULTS = os.environ.get("BENCH_RESULTS") or None
EVENTS = os.environ.get("BENCH_EVENTS", "")

if os.environ.get("BENCH_LOOP") == "uvloop":  # a worker of a --loop uvloop run
    import uvloop

    # Every event loop of the worker's processes (the lock's loop thread, the ablation's)
    # is made by asyncio.new_event_loop(), so by this policy.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

app = Celery("asynclock_bench", broker=BROKER, backend=RESULTS)
app.conf.update(
    asynclock_url=os.environ.get("BENCH_LOCKS") or None,
    singleton_backend_url=os.environ.get("BENCH_LOCKS") or None,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ.get("BENCH_LOCKS") or "redis://", "default_timeout": 60},
    },
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    if EVENTS:
        redis.Redis.from_url(EVENTS).rpush("ready", "1")


@app.task(name="bench.plain")
def plain(i: int) -> int:
    return i


@app.task(name="bench.locked", base=LockedTask, lock="bench:{i}", lock_ttl=30)
def locked(i: int) -> int:
    return i


@app.task(name="bench.lose", bind=True, base=LockedTask, lock="loss:{i}", lock_ttl=30)
def lose(self: LockedTask, i: int) -> None:
    started = time.monotonic()
    try:
        force_loss(self.lease, "benchmark")
        time.sleep(10)
    except asynclock.LeaseLost:
        redis.Redis.from_url(EVENTS).rpush("loss", json.dumps(time.monotonic() - started))


_floor_client: list[redis.Redis] = []


@app.task(name="bench.floor")
def floor(i: int) -> int:
    if not _floor_client:  # one client per child, made after the fork
        _floor_client.append(redis.Redis.from_url(os.environ["BENCH_LOCKS"]))
    client = _floor_client[0]
    key = f"floor:{i}"
    client.set(key, "owner", nx=True, px=30_000)
    client.delete(key)
    return i


# The guarantee floor: the least a lock keeping G2 (a token from a counter that only
# rises) and G6 (an owner-checked release) sends, one script per round trip. No grace, no
# queue, no renewal, no watch on the lease.
_TAKE = """
local token = redis.call('INCR', KEYS[2])
if redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'NX', 'PX', ARGV[2]) then
  return token
end
return nil
"""
_GIVE_BACK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_scripts: list[tuple[Any, Any]] = []


@app.task(name="bench.guaranteed")
def guaranteed(i: int) -> int:
    if not _scripts:  # registered once per child, after the fork
        client = redis.Redis.from_url(os.environ["BENCH_LOCKS"])
        _scripts.append((client.register_script(_TAKE), client.register_script(_GIVE_BACK)))
    take, give_back = _scripts[0]
    key, owner = f"guaranteed:{i}", f"{os.getpid()}-{i}"
    token = take(keys=[key, f"{key}:fence"], args=[owner, 30_000])
    give_back(keys=[key], args=[f"{owner}:{token}"])
    return i


_hop: list[tuple[asyncio.AbstractEventLoop, asynclock.Backend]] = []
_keeper: list[concurrent.futures.Future[None]] = []


def _hop_backend() -> tuple[asyncio.AbstractEventLoop, asynclock.Backend]:
    """A loop thread with an open Redis backend, one per child (made after the fork)."""
    if not _hop:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="bench-hop", daemon=True).start()
        opened: concurrent.futures.Future[asynclock.Backend] = concurrent.futures.Future()

        async def keep_open() -> None:
            async with asynclock.connect(os.environ["BENCH_LOCKS"]) as backend:
                opened.set_result(backend)
                await asyncio.Event().wait()  # open for the child's life

        _keeper.append(asyncio.run_coroutine_threadsafe(keep_open(), loop))
        _hop.append((loop, opened.result()))
    return _hop[0]


async def _take_and_give_back(backend: asynclock.Backend, name: str) -> None:
    lease = await backend.acquire(name, ttl=30, blocking=False)
    await lease.release()


@app.task(name="bench.hop")
def hop(i: int) -> int:
    loop, backend = _hop_backend()
    asyncio.run_coroutine_threadsafe(_take_and_give_back(backend, f"hop:{i}"), loop).result()
    return i


PEERS: dict[str, Any] = {}
try:
    from celery_singleton import Singleton

    @app.task(name="bench.singleton", base=Singleton)
    def singleton(i: int) -> int:
        return i

    PEERS["celery-singleton"] = singleton
except ImportError:  # pragma: no cover - a bench-group peer
    pass
try:
    from celery_once import QueueOnce

    @app.task(name="bench.once", base=QueueOnce, once={"graceful": False})
    def once(i: int) -> int:
        return i

    PEERS["celery-once"] = once
except ImportError:  # pragma: no cover - a bench-group peer
    pass


# -- the driver ------------------------------------------------------------------------


def start_worker(
    server_url: str, pool: str, concurrency: int, log: Path, loop: str = "asyncio"
) -> subprocess.Popen[bytes]:
    base = server_url.rsplit("/", 1)[0]
    env = {
        **os.environ,
        "BENCH_LOOP": loop,
        "PYTHONPATH": str(ROOT),
        "BENCH_BROKER": f"{base}/1",
        "BENCH_RESULTS": f"{base}/2",
        "BENCH_EVENTS": f"{base}/3",
        "BENCH_LOCKS": f"{base}/4",
    }
    events = redis.Redis.from_url(f"{base}/3", socket_timeout=90)
    events.delete("ready", "loss")
    args = [
        sys.executable, "-m", "celery", "-A", "benchmarks.bench_celery", "worker",
        "-P", pool, "-c", str(concurrency), "--without-gossip", "--without-mingle",
        "--without-heartbeat", "--loglevel", "WARNING",
    ]  # fmt: skip
    with log.open("ab") as out:
        process = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=out)
    if events.blpop(["ready"], timeout=60) is None:
        process.kill()
        raise SystemExit(f"the {pool} worker did not start; see {log}")
    return process


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _worker_pids(process: subprocess.Popen[bytes]) -> list[int]:
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    return [process.pid, *(int(c) for c in children.read_text().split())]


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (all their threads) so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def throughput(
    worker: subprocess.Popen[bytes], task: Any, n: int, offset: int, server_pid: int
) -> tuple[float, float, float, float]:
    """(worker, sender + worker) throughput, then the CPU seconds per task of the worker's
    processes and of the Redis server: the tasks are queued while the worker is stopped
    (SIGSTOP); the first rate is timed from SIGCONT to the last result's ``date_done``, the
    second from the first ``apply_async`` (which is where the peers lock)."""
    pids = _worker_pids(worker)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    sending = time.time()
    try:
        results = [task.apply_async((offset + i,)) for i in range(n)]
    finally:
        cpu = _cpu_seconds(pids), _cpu_seconds([server_pid])
        started = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for result in results:
        result.get(timeout=120)
    worker_cpu = (_cpu_seconds(pids) - cpu[0]) / n
    server_cpu = (_cpu_seconds([server_pid]) - cpu[1]) / n
    done = max(float(result.date_done.timestamp()) for result in results)
    return n / (done - started), n / (done - sending), worker_cpu, server_cpu


def loss_latencies(base: str, samples: int) -> list[float]:
    events = redis.Redis.from_url(f"{base}/3", socket_timeout=90)
    for i in range(samples):
        lose.apply_async((i,))
    found: list[float] = []
    for _ in range(samples):
        popped = events.blpop(["loss"], timeout=60)
        if popped is None:
            break
        found.append(float(json.loads(popped[1])))
    return found


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


Tuple4 = tuple[float, float, float, float]


def part_a(
    worker: subprocess.Popen[bytes],
    variants: dict[str, Any],
    opts: Any,
    server_pid: int,
    offsets: Iterator[int],
) -> dict[str, list[Tuple4]]:
    """Each variant ``opts.reps`` times on ``worker``, in a rotating order (task arguments
    from ``offsets``: never the same lock name twice in a benchmark)."""
    runs: dict[str, list[Tuple4]] = {n: [] for n in variants}
    for task in variants.values():  # warm up: connections, child imports
        throughput(worker, task, 20, 10**8, server_pid)
    names = list(variants)
    for rep in range(opts.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            offset = next(offsets)
            runs[name].append(throughput(worker, variants[name], opts.tasks, offset, server_pid))
    return runs


def print_part_a(loop: str, load: list[float], runs: dict[str, list[Tuple4]]) -> None:
    print(
        f"\nA. throughput, one prefork worker (concurrency 2), Redis broker + results, "
        f"event loop {loop} (load average {load[0]:.2f} before, {load[1]:.2f} after)"
    )
    medians = {
        name: [statistics.median(run[k] for run in values) for k in range(4)]
        for name, values in runs.items()
    }
    plain_rate, plain_total, plain_cpu, plain_server = medians["plain task"]
    floor_rate = medians["floor: SET NX + DEL"][0]
    kept_rate = medians["floor + token, owner"][0]
    print(
        f"  {'':<22} {'':>15} {'':>9} {'':>9} {'':>7} {'':>17} {'':>9}  {'CPU ms per task':^26}\n"
        f"  {'variant':<22} {'worker tasks/s':>15} {'vs plain':>9} {'vs floor':>9} {'vs f+g':>7} "
        f"{'send+run tasks/s':>17} {'vs plain':>9}  {'worker':>7} {'redis':>7} {'added':>7}"
    )
    for name, (rate, total, cpu, server_cpu) in medians.items():
        added = cpu + server_cpu - plain_cpu - plain_server
        print(
            f"  {name:<22} {rate:>15.0f} {rate / plain_rate:>8.2f}x {rate / floor_rate:>8.2f}x "
            f"{rate / kept_rate:>6.2f}x "
            f"{total:>17.0f} {total / plain_total:>8.2f}x  "
            f"{cpu * 1000:>7.3f} {server_cpu * 1000:>7.3f} {added * 1000:>+7.3f}"
        )
    print(
        "  (CPU: the worker's processes, all threads, and the Redis server, which also\n"
        "  serves the broker and the results; added: over the plain task's;\n"
        "  vs f+g: against the floor + token, owner row)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few tasks, 1 rep")
    parser.add_argument("--no-loss", action="store_true", help="skip part B (loss latency)")
    _loops.add_option(parser)
    opts = parser.parse_args()
    if opts.quick:
        opts.tasks, opts.reps, opts.samples = 100, 1, 20
    with tempfile.TemporaryDirectory(prefix="bench-celery-") as tmp:
        factory = RedisFactory(Path(tmp))
        try:
            server = factory()
            server.settle(4)  # the locks' db as a server long in service (no restart grace)
            base = server.url.rsplit("/", 1)[0]
            app.conf.update(
                broker_url=f"{base}/1",
                result_backend=f"{base}/2",
                asynclock_url=f"{base}/4",
                singleton_backend_url=f"{base}/4",
            )
            app.conf.ONCE["settings"]["url"] = f"{base}/4"
            log = Path(tmp) / "worker.log"
            variants: dict[str, Any] = {
                "plain task": plain,
                "floor: SET NX + DEL": floor,
                "floor + token, owner": guaranteed,
                "ablation: lock, 1 hop": hop,
                "LockedTask (redis)": locked,
            }
            variants.update(PEERS)
            assert server.process is not None
            tables: dict[str, tuple[list[float], dict[str, list[Tuple4]]]] = {}
            latencies: dict[str, list[float]] = {}
            offsets = itertools.count(opts.tasks, opts.tasks)
            for loop in _loops.chosen(opts):
                load = [os.getloadavg()[0]]
                worker = start_worker(server.url, "prefork", 2, log, loop)
                try:
                    runs = part_a(worker, variants, opts, server.process.pid, offsets)
                    load.append(os.getloadavg()[0])
                    if not opts.no_loss and loop == "asyncio":
                        latencies["prefork"] = loss_latencies(base, opts.samples)
                finally:
                    stop_worker(worker)
                tables[loop] = (load, runs)
            if not opts.no_loss:
                worker = start_worker(server.url, "solo", 1, log)
                try:
                    latencies["solo"] = loss_latencies(base, opts.samples)
                finally:
                    stop_worker(worker)
        finally:
            factory.close()

    print(f"asynclock Celery benchmark — Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {opts.tasks} no-op tasks x {opts.reps} reps")  # fmt: skip
    for loop, (load, runs) in tables.items():
        print_part_a(loop, load, runs)
    missing = {"celery-singleton", "celery-once"} - set(PEERS)
    if missing:
        print(f"  (not installed: {', '.join(sorted(missing))})")
    if opts.no_loss:
        return
    print("\nB. loss -> LeaseLost in the body (a sleeping sync task)")
    for pool, values in latencies.items():
        if values:
            print(
                f"  {pool:<8} n={len(values):<4} p50={p(values, 0.5) * 1000:6.1f} ms  "
                f"p99={p(values, 0.99) * 1000:6.1f} ms  max={max(values) * 1000:6.1f} ms"
            )
        else:
            print(f"  {pool:<8} no samples (see the worker log)")


if __name__ == "__main__":
    main()
