# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""Celery redelivery benchmark: how many times an acks_late task's body runs when the
Redis broker's visibility timeout is shorter than the task (issue 24).

One ``celery worker`` (prefork, concurrency 2) per variant, a real Redis broker with
``visibility_timeout`` 2 s swept every second (kombu's ``unacked_restore_interval`` and
``unacked_restore_throttle`` 1), one task sent once, whose body sleeps ``--task`` seconds
(10 by default); each body run and each delivery (``task_prerun``) is counted in Redis for
``--window`` seconds from the send (30 by default), then the worker is stopped:

* plain: ``@app.task(acks_late=True)``: every copy the broker delivers runs the body, and
  every copy still running after 2 s is delivered again;
* idempotent: ``base=LockedTask, idempotent=True, acks_late=True``: the first delivery runs
  the body; every other copy waits for its result (``on_busy="wait"``) and returns it.

Usage::

    uv run python -m benchmarks.bench_celery_redelivery [--task S] [--window S] [--quick]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

from asynclock_celery import LockedTask
from tests.support.redis_servers import RedisFactory

ROOT = Path(__file__).resolve().parents[1]
EVENTS = os.environ.get("BENCH_EVENTS", "")
VISIBILITY = 2

app = Celery(
    "asynclock_bench_redelivery",
    broker=os.environ.get("BENCH_BROKER", "memory://"),
    backend=os.environ.get("BENCH_RESULTS") or None,
)
app.conf.update(
    asynclock_url=os.environ.get("BENCH_LOCKS") or None,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


def _count(what: str, key: str) -> None:
    redis.Redis.from_url(EVENTS).incr(f"{what}:{key}")


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    if EVENTS:
        redis.Redis.from_url(EVENTS).rpush("ready", "1")


@signals.task_prerun.connect
def _delivered(args: Any = (), **_: Any) -> None:
    if EVENTS and args:
        _count("deliveries", str(args[0]))


@app.task(name="bench_redelivery.plain", acks_late=True)
def plain(key: str, seconds: float) -> str:
    _count("runs", key)
    time.sleep(seconds)
    return key


@app.task(
    name="bench_redelivery.idempotent",
    base=LockedTask,
    idempotent=True,
    acks_late=True,
    lock_ttl=10,
)
def idempotent(key: str, seconds: float) -> str:
    _count("runs", key)
    time.sleep(seconds)
    return key


# -- the driver ------------------------------------------------------------------------


def start_worker(base: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "BENCH_BROKER": f"{base}/1",
        "BENCH_RESULTS": f"{base}/2",
        "BENCH_EVENTS": f"{base}/3",
        "BENCH_LOCKS": f"{base}/4",
    }
    events = redis.Redis.from_url(f"{base}/3", socket_timeout=90)
    events.delete("ready")
    args = [
        sys.executable, "-m", "celery", "-A", "benchmarks.bench_celery_redelivery", "worker",
        "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "--loglevel", "WARNING",
    ]  # fmt: skip
    with log.open("ab") as out:
        process = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=out)
    if events.blpop(["ready"], timeout=60) is None:
        process.kill()
        raise SystemExit(f"the worker did not start; see {log}")
    return process


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker and its children: the plain variant's copies would run on."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    pids = [int(c) for c in children.read_text().split()] if children.exists() else []
    process.kill()
    process.wait()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def measure(base: str, task: Any, seconds: float, window: float, log: Path) -> dict[str, Any]:
    client = redis.Redis.from_url(f"{base}/1")
    client.flushdb()  # no copy of an earlier variant is left in the queue
    key = f"{task.name.rsplit('.', 1)[-1]}-{time.time_ns()}"
    events = redis.Redis.from_url(f"{base}/3")
    worker = start_worker(base, log)
    try:
        sent = time.monotonic()
        result = task.apply_async((key, seconds))
        value = result.get(timeout=window + 60)
        first = time.monotonic() - sent
        time.sleep(max(0.0, window - (time.monotonic() - sent)))  # the observation window
        runs = int(events.get(f"runs:{key}") or 0)
        deliveries = int(events.get(f"deliveries:{key}") or 0)
    finally:
        stop_worker(worker)
    return {"runs": runs, "deliveries": deliveries, "first": first, "ok": value == key}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", type=float, default=10.0, help="seconds the body sleeps")
    parser.add_argument("--window", type=float, default=30.0, help="seconds observed")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 s task, 8 s window")
    opts = parser.parse_args()
    if opts.quick:
        opts.task, opts.window = 4.0, 8.0
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-celery-redelivery-") as tmp:
        factory = RedisFactory(Path(tmp))
        try:
            server = factory()
            server.settle(4)  # the locks' db as a server long in service (no restart grace)
            base = server.url.rsplit("/", 1)[0]
            app.conf.update(broker_url=f"{base}/1", result_backend=f"{base}/2")
            log = Path(tmp) / "worker.log"
            for name, task in (("plain acks_late task", plain), ("idempotent", idempotent)):
                rows[name] = measure(base, task, opts.task, opts.window, log)
        finally:
            factory.close()
    print(
        f"asynclock Celery redelivery — Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs; prefork worker, concurrency 2"
    )
    print(
        f"visibility_timeout {VISIBILITY} s, {opts.task:g} s task, observed {opts.window:g} s "
        "from the send:"
    )
    print(f"  {'variant':<22} {'deliveries':>10} {'body runs':>10} {'first result':>13}")
    for name, row in rows.items():
        print(
            f"  {name:<22} {row['deliveries']:>10} {row['runs']:>10} "
            f"{row['first']:>12.1f}s{'' if row['ok'] else '  (wrong result!)'}"
        )
    summary = ", ".join(f"{name}: {row['runs']}" for name, row in rows.items())
    print(f"body runs — {summary}")


if __name__ == "__main__":
    main()
