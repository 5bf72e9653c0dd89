# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""Idempotent Celery tasks (issue 24, part 2) in real ``celery worker`` processes (prefork,
2 children) on a real Redis broker: re-sent tasks replay the stored result, acks_late
redelivery after a short visibility timeout runs the body once, and the defaults on a
freshly started lock server."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import asynclock
from asynclock_celery import LockedTask, locked
from asynclock_celery.testing import force_loss
from tests.integrations import celery_tasks as tasks
from tests.integrations.test_celery_worker import WAIT, configure_client, send, unique
from tests.support.celery_worker import (
    CeleryWorker,
    celery_redis,  # noqa: F401  (fixture)
    redis_db,
    start_celery_worker,
)
from tests.support.redis_servers import RedisServer

#: The broker's visibility timeout: a run still unacknowledged after it is delivered again.
VISIBILITY = 2


@contextlib.contextmanager
def worker_on(
    broker: RedisServer, lock_url: str, directory: Path, **env: str
) -> Iterator[CeleryWorker]:
    configure_client(broker)
    worker = start_celery_worker(
        broker, directory, pool="prefork", concurrency=2, lock_url=lock_url, ttl=1.0, env=env
    )
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def worker(
    celery_redis: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CeleryWorker]:
    """acks_late tasks are delivered again after VISIBILITY seconds (swept every second)."""
    lock_url = redis_db(celery_redis, 4) + "?restart_grace=0"
    directory = tmp_path_factory.mktemp("idempotent")
    with worker_on(celery_redis, lock_url, directory, ALT_VISIBILITY=str(VISIBILITY)) as w:
        yield w


def runs(worker: CeleryWorker, key: str) -> int:
    return int(redis.Redis.from_url(worker.events_url).get(f"runs:{key}") or 0)


def outcome(result: Any) -> Any:
    result.get(timeout=WAIT, propagate=False)
    return result.state, result.result


def test_a_resent_task_returns_the_stored_result(worker: CeleryWorker) -> None:
    order = f"o{unique()}"
    first = send(tasks.charge, worker, order, 10)
    stored = first.get(timeout=WAIT)
    again = send(tasks.charge, worker, order, 10)  # the same request, a new task id
    assert again.id != first.id
    assert again.get(timeout=WAIT) == stored
    assert runs(worker, f"charge:{order}") == 1
    # The same key with another fingerprinted argument: refused, not retried, nothing ran.
    state, error = outcome(send(tasks.charge, worker, order, 11))
    assert state == "FAILURE" and isinstance(error, asynclock.IdempotencyKeyReused), error
    # An argument outside the fingerprint does not make it another request.
    assert send(tasks.charge, worker, order, 10, "decline").get(timeout=WAIT) == stored
    assert runs(worker, f"charge:{order}") == 1


def test_a_failed_run_frees_the_key_and_a_stored_failure_replays(worker: CeleryWorker) -> None:
    order = f"o{unique()}"
    state, error = outcome(send(tasks.charge, worker, order, 5, "once"))
    assert state == "FAILURE" and isinstance(error, RuntimeError), error
    result = send(tasks.charge, worker, order, 5, "once").get(timeout=WAIT)  # runs again
    assert result["order"] == order and runs(worker, f"charge:{order}") == 2

    declined = f"o{unique()}"
    state, error = outcome(send(tasks.charge, worker, declined, 5, "decline"))
    assert state == "FAILURE" and type(error).__name__ == "PermanentDecline", error
    state, error = outcome(send(tasks.charge, worker, declined, 5, "decline"))
    assert state == "FAILURE" and isinstance(error, asynclock.ReplayedFailure), error
    assert error.error_type == "tests.integrations.celery_tasks.PermanentDecline"
    assert runs(worker, f"charge:{declined}") == 1


def test_on_busy_retry_retries_while_the_key_runs_then_replays(worker: CeleryWorker) -> None:
    key = f"k{unique()}"
    first = send(tasks.held_job, worker, key)
    worker.expect("holding", key=key)
    duplicate = send(tasks.retried_job, worker, key)
    worker.expect("retry", task_id=duplicate.id)  # InProgress: retried, nothing ran
    worker.go(key)
    assert first.get(timeout=WAIT) == duplicate.get(timeout=WAIT) == f"done {key}"
    assert runs(worker, f"held:{key}") == 1


def test_a_frozen_run_is_replaced_and_its_result_is_never_stored(worker: CeleryWorker) -> None:
    """A run frozen past its lease: the re-sent run waits for the key, takes it over when
    the lease expires (a larger token) and stores its result; the frozen run wakes, fails
    with LeaseLost, and stores nothing: later runs replay the successor's result."""
    order = f"o{unique()}"
    first = send(tasks.frozen_charge, worker, order, True)
    frozen = worker.expect("frozen_started", order=order, n=1)
    try:
        second = send(tasks.frozen_charge, worker, order)
        label, token = second.get(timeout=WAIT)
        assert label == "second" and token > frozen["token"]
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    state, error = outcome(first)
    assert state == "FAILURE" and isinstance(error, asynclock.LeaseLost), repr(error)
    assert error.token == frozen["token"]
    assert send(tasks.frozen_charge, worker, order, True).get(timeout=WAIT) == ["second", token]
    assert runs(worker, f"frozen:{order}") == 2


def redelivered(worker: CeleryWorker, task: Any, key: str) -> Any:
    """Send ``task(key)``; return its result once the broker has delivered it a second
    time while its first run was still in the body (then the first run may finish)."""
    result = send(task, worker, key)
    worker.expect("body", timeout=WAIT, key=key, n=1)
    worker.expect("prerun", timeout=WAIT, task_id=result.id)
    worker.expect("prerun", timeout=WAIT, task_id=result.id)  # the redelivered copy
    return result


def test_redelivery_runs_a_plain_acks_late_task_again(worker: CeleryWorker) -> None:
    """The failure idempotency exists for: without it, the copy runs the body again."""
    key = f"plain{unique()}"
    result = redelivered(worker, tasks.slow_plain, key)
    worker.expect("body", timeout=WAIT, key=key, n=2)
    worker.go(key)
    result.get(timeout=WAIT)
    assert runs(worker, key) >= 2


def test_redelivery_of_an_idempotent_task_replays_the_result(worker: CeleryWorker) -> None:
    key = f"idem{unique()}"
    result = redelivered(worker, tasks.slow_idempotent, key)
    # The copy waits for the run in progress (on_busy="wait"), then replays its result.
    worker.go(key)
    assert result.get(timeout=WAIT) == 1
    worker.expect("postrun", timeout=WAIT, task_id=result.id, replayed=True, state="SUCCESS")
    assert runs(worker, key) == 1


def test_the_defaults_on_a_freshly_started_lock_server(
    celery_redis: RedisServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    """No idempotency option but idempotent=True, a lock server started just now (in its
    restart grace): duplicates sent at once run the body once and all get its result."""
    server = RedisServer(tmp_path / "locks").start(settle=False)
    try:
        with worker_on(celery_redis, server.url, tmp_path) as worker:
            key = f"k{unique()}"
            sent = [send(tasks.defaults, worker, key, 3) for _ in range(4)]
            results = [r.get(timeout=WAIT) for r in sent]
            assert results[0][:2] == [key, 3] and results == [results[0]] * 4
            assert runs(worker, f"defaults:{key}") == 1
            state, error = outcome(send(tasks.defaults, worker, key, 4))  # another request
            assert state == "SUCCESS" and error[1] == 4 and runs(worker, f"defaults:{key}") == 2
    finally:
        server.stop()


# -- without a worker: declaration checks and eager runs ----------------------------------


class Declined(Exception):
    """A stored failure (module level: Celery pickles a task's exception)."""


def make_app(directory: Path) -> Celery:
    app = Celery("idem", broker="memory://", backend="cache+memory://")
    app.conf.asynclock_url = f"sqlite:///{directory / 'locks.db'}"
    return app


def test_idempotency_options_are_checked_where_the_task_is_declared(tmp_path: Path) -> None:
    app = make_app(tmp_path)

    def pay(order: str, amount: int) -> None: ...

    def declare(**options: Any) -> None:
        app.task(base=LockedTask, name=f"t{unique()}", lazy=False, **options)(pay)

    with pytest.raises(ValueError, match="idempotency_key set without idempotent=True"):
        declare(idempotency_key="pay:{order}")
    with pytest.raises(TypeError, match=r"uses ordr, which task .*pay\(\) does not take"):
        declare(idempotent=True, idempotency_key="pay:{ordr}")
    with pytest.raises(TypeError, match=r"idempotency_fingerprint names currency, which task"):
        declare(idempotent=True, idempotency_fingerprint=("amount", "currency"))
    with pytest.raises(TypeError, match="idempotency_fingerprint must be a tuple of argument"):
        declare(idempotent=True, idempotency_fingerprint="amount")
    with pytest.raises(ValueError, match=r"idempotency_keep must be between 1 second and"):
        declare(idempotent=True, idempotency_keep=0.5)
    with pytest.raises(TypeError, match="idempotency_store_errors must be a tuple of Exception"):
        declare(idempotent=True, idempotency_store_errors=(KeyboardInterrupt,))
    with pytest.raises(ValueError, match="pass idempotent=True too"):
        locked("pay:{order}", store_errors=(ValueError,))
    with pytest.raises(TypeError, match=r"fingerprint names currency, which .*pay\(\)"):
        locked("pay:{order}", idempotent=True, fingerprint=("currency",))(pay)


def test_eager_runs_replay_refuse_reuse_and_free_the_key_on_failure(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    ran: list[tuple[Any, ...]] = []

    @app.task(
        bind=True,
        base=LockedTask,
        idempotent=True,
        idempotency_key="pay:{order}",
        idempotency_fingerprint=("amount",),
        idempotency_store_errors=(Declined,),
        lock_ttl=5,
    )
    def pay(self: LockedTask, order: int, amount: int, how: str = "") -> Any:
        ran.append((order, how))
        if how == "declined":
            raise Declined("no funds")
        if how == "flaky" and ran.count((order, how)) == 1:
            raise ConnectionError("provider timed out")
        if how == "set":
            return {1, 2}  # not JSON: refused, the key is freed
        return {"order": order, "token": self.request.fencing_token}

    first = pay.apply((1, 10), throw=True).get()
    assert pay.apply((1, 10), throw=True).get() == first and len(ran) == 1
    reused = pay.apply((1, 11))
    assert reused.state == "FAILURE" and isinstance(reused.result, asynclock.IdempotencyKeyReused)
    assert isinstance(pay.apply((2, 1, "flaky")).result, ConnectionError)
    assert pay.apply((2, 1, "flaky"), throw=True).get()["order"] == 2  # ran again
    assert isinstance(pay.apply((3, 1, "declined")).result, Declined)
    replayed = pay.apply((3, 1, "declined")).result
    assert isinstance(replayed, asynclock.ReplayedFailure) and replayed.message == "no funds"
    refused = pay.apply((4, 1, "set")).result
    assert isinstance(refused, TypeError) and "JSON-serialisable" in str(refused)
    assert pay.apply((4, 1), throw=True).get()["order"] == 4  # the key was freed
    assert [o for o, _ in ran] == [1, 2, 2, 3, 4, 4]

    @app.task
    @locked("sum:{a}", idempotent=True, ttl=5)
    def add(a: int, b: int) -> list[int]:
        ran.append((a, b))
        return [a + b]

    @app.task(base=LockedTask, idempotent=True, lock_ttl=5)
    async def mul(a: int, b: int = 2) -> int:
        ran.append((a, b))
        return a * b

    before = len(ran)
    assert add.apply((1, 2), throw=True).get() == add.apply((1, 2), throw=True).get() == [3]
    assert mul.apply((3,), throw=True).get() == mul.apply((3,), {"b": 2}, throw=True).get() == 6
    assert mul.apply((3, 3), throw=True).get() == 9  # other arguments: another key
    assert len(ran) == before + 3


def test_on_busy_skip_runs_a_later_copy_again_and_idempotent_does_not(tmp_path: Path) -> None:
    """docs/integrations/celery.md: a copy of an invoice task sent after the first run
    finished. ``on_busy="skip"`` skips only while the lock is held: it sends the invoice
    again. ``idempotent=True`` replays the first run's result."""
    app = make_app(tmp_path)
    sent: list[str] = []

    @app.task(base=LockedTask, lock="invoice:{n}", on_busy="skip", lock_ttl=5, name="by-skip")
    def skipping(n: int) -> str:
        sent.append("skip")
        return f"invoice {n}"

    @app.task(base=LockedTask, idempotent=True, idempotency_key="invoice:{n}", lock_ttl=5)
    def keyed(n: int) -> str:
        sent.append("idempotent")
        return f"invoice {n}"

    for task in (skipping, keyed):
        assert task.apply((7,), throw=True).get() == "invoice 7"
        assert task.apply((7,), throw=True).get() == "invoice 7"  # the copy, sent later
    assert sent == ["skip", "skip", "idempotent"]


def test_a_duplicate_while_the_first_runs_follows_on_busy(tmp_path: Path) -> None:
    """fail: InProgress at once; skip: SUCCESS None; wait: the first run's result."""
    app = make_app(tmp_path)
    started, go = threading.Event(), threading.Event()
    key = "job:{n}"

    @app.task(base=LockedTask, idempotent=True, idempotency_key=key, lock_ttl=5)
    def first(n: int) -> int:
        started.set()
        assert go.wait(WAIT)
        return n * 10

    def duplicate(on_busy: str) -> Any:
        def job(n: int) -> int:
            raise AssertionError("a duplicate ran the body")

        return app.task(
            base=LockedTask,
            name=f"dup_{on_busy}",
            idempotent=True,
            idempotency_key=key,
            on_busy=on_busy,
            lock_ttl=5,
        )(job)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(lambda: first.apply((7,), throw=True).get())
        assert started.wait(WAIT)
        failed = duplicate("fail").apply((7,))
        assert failed.state == "FAILURE" and isinstance(failed.result, asynclock.InProgress)
        skipped = duplicate("skip").apply((7,))
        assert skipped.state == "SUCCESS" and skipped.result is None
        waiting = pool.submit(lambda: duplicate("wait").apply((7,), throw=True).get())
        go.set()
        assert running.result(WAIT) == 70 and waiting.result(WAIT) == 70


def test_a_lost_lease_stops_the_body_and_frees_the_key(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    ran: list[int] = []

    @app.task(bind=True, base=LockedTask, idempotent=True, lock_ttl=5)
    def work(self: LockedTask, n: int) -> int:
        ran.append(n)
        if len(ran) == 1:
            force_loss(self.lease, "test: lost mid-run")
            time.sleep(WAIT)  # LeaseLost interrupts this
        return n

    lost = work.apply((1,))
    assert lost.state == "FAILURE" and isinstance(lost.result, asynclock.LeaseLost)
    assert work.apply((1,), throw=True).get() == 1 and ran == [1, 1]


def test_example_celery_idempotent() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "celery_idempotent.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == lines[1].replace("sent again:", "first send:")  # the same receipt
    assert lines[2].endswith("FAILURE IdempotencyKeyReused")
    assert lines[3].endswith("FAILURE CardDeclined")
    assert lines[4].endswith("FAILURE ReplayedFailure")
    assert lines[5] == "charges made: [('A-1', 25)]"
