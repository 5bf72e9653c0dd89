"""Issue 21 item 1: locked tasks in a real ``celery worker`` (prefork, 2 children) whose lock
server is a Redis that lost its data: freshly started, or killed with ``kill -9`` and
started again without persistence. Default options: no ``restart_grace`` in the URL."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

import asynclock
from asynclock.backends.redis import keys_for
from tests.integrations import celery_tasks as tasks
from tests.integrations.test_celery_worker import WAIT, configure_client, send, unique
from tests.support.celery_worker import (
    CeleryWorker,
    celery_redis,  # noqa: F401  (fixture)
    start_celery_worker,
)
from tests.support.redis_servers import RedisServer, wait_until

#: The tasks' lock_ttl: with no restart_grace option, also the grace a lost database waits.
TTL = 2.0


@pytest.fixture
def lock_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server started just now, as a user gets it: its database has no epoch."""
    server = RedisServer(tmp_path / "locks").start(settle=False)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def worker_on(
    broker: RedisServer, lock_server: RedisServer, directory: Path
) -> Iterator[CeleryWorker]:
    configure_client(broker)
    worker = start_celery_worker(
        broker, directory, pool="prefork", concurrency=2, lock_url=lock_server.url, ttl=TTL
    )
    try:
        yield worker
    finally:
        worker.stop()


def log_since(worker: CeleryWorker, offset: int) -> str:
    with worker.log.open() as log:
        log.seek(offset)
        return log.read()


def test_first_runs_on_a_fresh_lock_server_succeed(
    celery_redis: RedisServer,  # noqa: F811
    lock_server: RedisServer,
    tmp_path: Path,
) -> None:
    """Every policy: the first runs wait out the grace (a queued run is sent again at its
    end, its retries not counted: max_retries=0 here) and succeed. Before: on_busy="fail"
    ended FAILURE LockHeld, "skip" dropped the run, "retry" spent its retries."""
    started = time.monotonic()
    with worker_on(celery_redis, lock_server, tmp_path) as worker:
        in_grace = time.monotonic() - started < tasks.GRACE_TTL - 1.0  # else the machine is slow
        runs = [
            send(task, worker, f"{unique()}")
            for task in (tasks.fresh_default, tasks.fresh_retry, tasks.fresh_skip, tasks.fresh_fail)
        ]
        for result in runs:
            result.get(timeout=WAIT, propagate=False)
        assert [r.state for r in runs] == ["SUCCESS"] * 4, [repr(r.result) for r in runs]
        assert all(r.result is not None and r.result[1] == 0 for r in runs), [
            r.result for r in runs
        ]
        log = log_since(worker, 0)
        if in_grace:
            assert "restart grace" in log  # said once per process, at WARNING
        assert "ERROR" not in log and "Traceback" not in log, log


def test_kill_9_and_restart_of_the_lock_server_mid_run(
    celery_redis: RedisServer,  # noqa: F811
    lock_server: RedisServer,
    tmp_path: Path,
) -> None:
    """Runs of one key wait in the lock's queue behind a holder (this test) when the lock
    server is killed with kill -9 and started again with no data; more runs are sent while
    it is down. Every run ends SUCCESS, one at a time, none lost."""
    key = str(unique())
    name = f"survive:{key}"
    holding, done = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    async def hold() -> None:
        async with asynclock.connect(lock_server.url) as backend:
            try:
                async with backend.lock(name, ttl=TTL, timeout=WAIT):
                    holding.set()
                    await anyio.to_thread.run_sync(done.wait, abandon_on_cancel=True)
            except asynclock.LeaseLost as lost:  # the server lost it: expected
                outcome.append(lost)
            else:
                outcome.append(None)

    holder = threading.Thread(target=anyio.run, args=(hold,))
    with worker_on(celery_redis, lock_server, tmp_path) as worker:
        holder.start()
        try:
            assert holding.wait(WAIT)
            results: list[Any] = [send(tasks.survivor, worker, key, n) for n in range(6)]

            async def both_children_wait() -> bool:
                """Both children wait in the lock's queue (or, as before the fix, a run
                was sent back to wait for a retry)."""
                locks = redis.Redis.from_url(lock_server.url)
                events = redis.Redis.from_url(worker.events_url)
                try:
                    if int(locks.zcard(keys_for(name).queue)) >= 2:
                        return True
                    return any(b'"retry"' in e for e in events.lrange("events", 0, -1))
                finally:
                    locks.close()
                    events.close()

            anyio.run(wait_until, both_children_wait, WAIT)
            lock_server.kill()
            results += [send(tasks.survivor, worker, key, n) for n in range(6, 10)]
            lock_server.start(settle=False)
        finally:
            done.set()
            holder.join(WAIT)
        for result in results:
            result.get(timeout=WAIT * 2, propagate=False)
        assert [r.state for r in results] == ["SUCCESS"] * 10, [repr(r.result) for r in results]
        assert [r.result for r in results] == [1] * 10  # never two runs in the body at once
        log = log_since(worker, 0)
        assert "Traceback" not in log, log
