"""asynclock_celery in real ``celery worker`` processes (prefork with 2 children, and solo)
on a real Redis broker and result backend; locks on Redis and on SQLite."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from celery import Celery

import asynclock
from tests.integrations import celery_tasks as tasks
from tests.support.celery_worker import (
    CeleryWorker,
    celery_redis,  # noqa: F401  (fixture)
    redis_db,
    start_celery_worker,
)
from tests.support.redis_servers import RedisServer

TTL = 1.0
#: Generous: the machine is shared; a loaded worker is slow, not wrong.
WAIT = 30.0


_clients: dict[str, Celery] = {}


def configure_client(server: RedisServer) -> None:
    """The test's own Celery app (sends by task name, reads results): the tasks module's app
    may have been used eagerly, with no broker or result backend, by other tests."""
    if server.url not in _clients:
        _clients[server.url] = Celery(
            "asynclock_tests_client", broker=redis_db(server, 1), backend=redis_db(server, 2)
        )
    _clients["current"] = _clients[server.url]


def lock_url_for(kind: str, server: RedisServer, directory: Path) -> str:
    if kind == "redis":
        # No restart grace: the suite's Redis is fresh, and these tests are not about it.
        return redis_db(server, 4) + "?restart_grace=0"
    return f"sqlite:///{directory / 'locks.db'}"


@contextlib.contextmanager
def running_worker(
    server: RedisServer, directory: Path, *, kind: str, pool: str, concurrency: int
) -> Iterator[tuple[CeleryWorker, str]]:
    """A real `celery worker` on ``server`` with locks on ``kind`` (redis or sqlite), and
    its lock URL; stopped on exit."""
    url = lock_url_for(kind, server, directory)
    configure_client(server)
    worker = start_celery_worker(
        server, directory, pool=pool, concurrency=concurrency, lock_url=url, ttl=TTL
    )
    try:
        yield worker, url
    finally:
        worker.stop()


@pytest.fixture(scope="module", params=["redis", "sqlite"])
def prefork(
    request: pytest.FixtureRequest,
    celery_redis: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CeleryWorker, str]]:
    directory = tmp_path_factory.mktemp(f"prefork-{request.param}")
    with running_worker(
        celery_redis, directory, kind=request.param, pool="prefork", concurrency=2
    ) as running:
        yield running


@pytest.fixture(scope="module")
def solo(
    celery_redis: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CeleryWorker, str]]:
    directory = tmp_path_factory.mktemp("solo")
    with running_worker(celery_redis, directory, kind="redis", pool="solo", concurrency=1) as w:
        yield w


def send(task: Any, worker: CeleryWorker, *args: Any, **kwargs: Any) -> Any:
    return _clients["current"].send_task(task.name, args, kwargs, queue=worker.queue)


def wait_until_expired(url: str, name: str) -> None:
    """Return once the server has let the frozen holder's lease of ``name`` expire:
    a fresh client can take it (then gives it back)."""

    async def take() -> None:
        async with asynclock.connect(url) as backend:
            async with backend.lock(name, ttl=5.0, timeout=WAIT):
                pass

    anyio.run(take)


def assert_free(url: str, name: str) -> None:
    """``name`` is free right now: a fresh client takes it at once (then gives it back)."""

    async def take() -> None:
        async with asynclock.connect(url) as backend:
            async with backend.lock(name, ttl=5.0, blocking=False):
                pass

    anyio.run(take)


def ledger_rows(fence_db: str) -> list[tuple[str, int]]:
    conn = sqlite3.connect(fence_db)
    try:
        return [(w, t) for w, t in conn.execute("SELECT writer, token FROM ledger ORDER BY rowid")]
    finally:
        conn.close()


def unique() -> int:
    return uuid.uuid4().int % 10**9


# -- prefork -------------------------------------------------------------------------------


def test_stale_holder_is_stopped_and_its_write_fenced(prefork: tuple[CeleryWorker, str]) -> None:
    """The issue's scenario: a child holding acct:N freezes past its ttl; the same task runs
    in the other child with a larger token; the first child wakes: its run fails with
    LeaseLost and its late write is rejected by the fence."""
    worker, _ = prefork
    account = unique()
    first = send(tasks.ledger, worker, account, "first", freeze=True)
    frozen = worker.expect("freezing", writer="first")
    try:
        second = send(tasks.ledger, worker, account, "second")
        token2 = second.get(timeout=WAIT)
        started2 = worker.expect("started", writer="second")
        assert started2["pid"] != frozen["pid"]
        assert token2 > frozen["token"]
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    first.get(timeout=WAIT, propagate=False)
    assert first.state == "FAILURE"
    assert isinstance(first.result, asynclock.LeaseLost), repr(first.result)
    assert first.result.token == frozen["token"]
    assert worker.expect("late_write", writer="first")["result"] == "stale"
    rows = ledger_rows(worker.fence_db)
    mine = [row for row in rows if row[0] in ("first-before-pause", "second", "first-after-pause")]
    assert mine[-2:] == [("first-before-pause", frozen["token"]), ("second", token2)]


def test_swallowed_lease_lost_still_fails(prefork: tuple[CeleryWorker, str]) -> None:
    worker, url = prefork
    key = str(unique())
    result = send(tasks.swallow, worker, key)
    started = worker.expect("started", key=key)
    try:
        wait_until_expired(url, f"swallow:{key}")
    finally:
        resumed = time.monotonic()
        os.kill(started["pid"], signal.SIGCONT)
    swallowed = worker.expect("swallowed", key=key)
    assert swallowed["at"] - resumed < 2.0  # measured: ~0.01 s on an idle machine
    result.get(timeout=WAIT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, asynclock.LeaseLost)
    assert result.result.name == f"swallow:{key}"


def test_on_busy_fail_skip_and_retry(prefork: tuple[CeleryWorker, str]) -> None:
    worker, _ = prefork
    key = str(unique())
    logged = worker.log.stat().st_size
    holder = send(tasks.hold, worker, key)
    holding = worker.expect("holding", key=key)
    try:
        failed = send(tasks.busy_fail, worker, key)
        failed.get(timeout=WAIT, propagate=False)
        assert failed.state == "FAILURE"
        assert isinstance(failed.result, asynclock.LockHeld)
        assert failed.result.name == f"hold:{key}"

        skipped = send(tasks.busy_skip, worker, key)
        assert skipped.get(timeout=WAIT) is None
        assert skipped.state == "SUCCESS"

        retried = send(tasks.busy_retry, worker, key)
        worker.expect("retry", task_id=retried.id)
    finally:
        worker.go(key)
    assert holder.get(timeout=WAIT) == holding["token"]
    assert retried.get(timeout=WAIT) >= 1
    ran = worker.expect("ran", key=key)
    assert ran["token"] > holding["token"]
    assert not [e for e in worker.seen if e["event"] == "ran" and e.get("key") == key]
    # A busy key is the policy at work, not a bug: no ERROR, no traceback for these runs.
    # (Only their own records: a task of an earlier test may log its end after this test
    # began, since Celery stores a result before it logs the outcome.)
    with worker.log.open() as log:
        log.seek(logged)
        records = re.split(r"\n(?=\[\d{4}-)", log.read())
    ids = (holder.id, failed.id, skipped.id, retried.id)
    new = "\n".join(r for r in records if any(i in r for i in ids) or key in r)
    assert "raised expected: LockHeld" in new, new
    assert "ERROR" not in new and "Traceback" not in new, new


def test_contention_with_the_defaults_all_succeed(prefork: tuple[CeleryWorker, str]) -> None:
    """Issue 21 item 2: 20 runs of one key, each holding it 0.2 s, in 2 children, lock_ttl
    6 and every other option at its default: all 20 succeed, one at a time, and nothing is
    logged at ERROR or with a traceback (before: several ended FAILURE LockHeld)."""
    worker, _ = prefork
    key = str(unique())
    logged = worker.log.stat().st_size
    results = [send(tasks.crowd, worker, key, n) for n in range(20)]
    deadline = time.monotonic() + 120
    for result in results:
        result.get(timeout=max(1.0, deadline - time.monotonic()), propagate=False)
    assert [r.state for r in results] == ["SUCCESS"] * 20, [repr(r.result) for r in results]
    assert [r.result for r in results] == [1] * 20  # never two runs in the body at once
    with worker.log.open() as log:
        log.seek(logged)
        new = log.read()
    assert "ERROR" not in new and "Traceback" not in new, new


def test_templates_async_and_stacked_tasks(prefork: tuple[CeleryWorker, str]) -> None:
    worker, _ = prefork
    assert send(tasks.report, worker, 7, region="us").get(timeout=WAIT) == "report:7:us"
    assert send(tasks.report, worker, customer_id=8).get(timeout=WAIT) == "report:8:eu"
    name, token = send(tasks.async_account, worker, 3).get(timeout=WAIT)
    assert name == "async:3" and token >= 1
    assert send(tasks.plain_locked, worker, "k", extra=2).get(timeout=WAIT) == "second:k:2"


def test_async_task_is_cancelled_on_loss(prefork: tuple[CeleryWorker, str]) -> None:
    worker, url = prefork
    account = unique()
    result = send(tasks.async_account, worker, account, freeze=True)
    started = worker.expect("started", account=account)
    try:
        wait_until_expired(url, f"async:{account}")
    finally:
        os.kill(started["pid"], signal.SIGCONT)
    result.get(timeout=WAIT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, asynclock.LeaseLost)


def test_soft_time_limit_releases_the_lock(prefork: tuple[CeleryWorker, str]) -> None:
    worker, url = prefork
    key = str(unique())
    result = send(tasks.soft_limited, worker, key)
    worker.expect("started", key=key)
    result.get(timeout=WAIT, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "SoftTimeLimitExceeded"

    assert_free(url, f"limit:{key}")  # released, not expired: its ttl is 30 s


def test_soft_time_limit_ends_a_wait_for_the_lock(prefork: tuple[CeleryWorker, str]) -> None:
    """on_busy="wait": a run waiting for the lock is ended by its soft time limit and leaves
    the lock's queue (the holder's release frees the name for anyone at once)."""
    worker, url = prefork
    key = str(unique())
    holder = send(tasks.hold_long, worker, key)
    holding = worker.expect("holding", key=key)
    try:
        waiter = send(tasks.wait_limited, worker, key)
        waiter.get(timeout=WAIT, propagate=False)
        assert waiter.state == "FAILURE"
        assert type(waiter.result).__name__ == "SoftTimeLimitExceeded"
    finally:
        worker.go(key)
    assert holder.get(timeout=WAIT) == holding["token"]

    assert_free(url, f"long:{key}")  # released; no waiter left behind holds the name
    assert not [e for e in worker.seen if e["event"] == "ran" and e.get("key") == key]


def test_hard_time_limit_leaves_the_lock_to_its_ttl(prefork: tuple[CeleryWorker, str]) -> None:
    worker, url = prefork
    key = str(unique())
    result = send(tasks.hard_limited, worker, key)
    worker.expect("started", key=key)
    result.get(timeout=WAIT, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "TimeLimitExceeded"
    wait_until_expired(url, f"limit:{key}")  # the killed child's lease expires (ttl 2 s)
    # The pool replaced the child; the worker still serves locked tasks.
    assert send(tasks.report, worker, 2).get(timeout=WAIT) == "report:2:eu"


def test_acks_late_redelivery_after_a_killed_child(prefork: tuple[CeleryWorker, str]) -> None:
    worker, _ = prefork
    key = str(unique())
    result = send(tasks.redelivered, worker, key)
    first = worker.expect("started", key=key, first=True)
    os.kill(first["pid"], signal.SIGKILL)  # OOM killer, a hard crash: no release at all
    token = result.get(timeout=WAIT)
    second = worker.expect("started", key=key, first=False)
    assert second["pid"] != first["pid"]
    assert token == second["token"] > first["token"]
    rows = [r for r in ledger_rows(worker.fence_db) if r[0] == f"run-{key}"]
    assert rows == [(f"run-{key}", token)]  # the killed run wrote nothing


# -- solo ----------------------------------------------------------------------------------


def test_solo_stale_holder_is_stopped_and_fenced(solo: tuple[CeleryWorker, str]) -> None:
    """Solo pool: the body runs in the worker's main process; the successor is this test."""
    worker, url = solo
    account = unique()
    first = send(tasks.ledger, worker, account, "first", freeze=True)
    frozen = worker.expect("freezing", writer="first")
    from tests.support.worker import fenced_write

    async def successor() -> int:
        async with asynclock.connect(url) as backend:
            async with backend.lock(f"acct:{account}", ttl=5.0, timeout=WAIT) as lease:
                written = fenced_write(worker.fence_db, f"acct:{account}", lease.token, "test")
        assert written == "accepted"
        return lease.token

    try:
        token2 = anyio.run(successor)
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    assert token2 > frozen["token"]
    first.get(timeout=WAIT, propagate=False)
    assert first.state == "FAILURE"
    assert isinstance(first.result, asynclock.LeaseLost)
    assert worker.expect("late_write", writer="first")["result"] == "stale"
    mine = [r for r in ledger_rows(worker.fence_db) if r[1] in (frozen["token"], token2)]
    assert mine == [("first-before-pause", frozen["token"]), ("test", token2)]


def test_solo_swallowed_lease_lost_still_fails(solo: tuple[CeleryWorker, str]) -> None:
    worker, url = solo
    key = str(unique())
    result = send(tasks.swallow, worker, key)
    started = worker.expect("started", key=key)
    try:
        wait_until_expired(url, f"swallow:{key}")
    finally:
        resumed = time.monotonic()
        os.kill(started["pid"], signal.SIGCONT)
    assert worker.expect("swallowed", key=key)["at"] - resumed < 2.0
    result.get(timeout=WAIT, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, asynclock.LeaseLost)
    # The worker is still alive and serves the next task (no stray SIGUSR2 killed it).
    assert send(tasks.report, worker, 1).get(timeout=WAIT) == "report:1:eu"


def test_threads_pool_interrupts_a_python_loop(
    celery_redis: RedisServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    """-P threads: the body is not on the main thread; LeaseLost comes as an async exception."""
    with running_worker(celery_redis, tmp_path, kind="redis", pool="threads", concurrency=2) as (
        worker,
        url,
    ):
        key = str(unique())
        result = send(tasks.spin_swallow, worker, key)
        started = worker.expect("started", key=key)
        assert started["main_thread"] is False
        try:
            wait_until_expired(url, f"spin:{key}")
        finally:
            resumed = time.monotonic()
            os.kill(started["pid"], signal.SIGCONT)
        assert worker.expect("swallowed", key=key)["at"] - resumed < 2.0
        result.get(timeout=WAIT, propagate=False)
        assert result.state == "FAILURE"
        assert isinstance(result.result, asynclock.LeaseLost)
        assert send(tasks.report, worker, 3).get(timeout=WAIT) == "report:3:eu"


def test_warm_shutdown_finishes_the_run_and_releases(
    celery_redis: RedisServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    with running_worker(celery_redis, tmp_path, kind="redis", pool="solo", concurrency=1) as (
        worker,
        url,
    ):
        key = str(unique())
        result = send(tasks.hold_long, worker, key)
        holding = worker.expect("holding", key=key)
        worker.process.send_signal(signal.SIGTERM)  # warm shutdown: the run may finish
        worker.go(key)
        assert result.get(timeout=WAIT) == holding["token"]
        assert worker.process.wait(timeout=WAIT) == 0

    assert_free(url, f"long:{key}")  # released at the end of the run (its ttl is 30 s)
