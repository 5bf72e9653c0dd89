# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""The Celery app the worker tests run in a real ``celery worker`` (and eagerly).

Configured from the environment the test's worker fixture sets (ALT_* variables below);
each task reports what happened to a Redis list (``events``) the test waits on with BLPOP.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import redis
from celery import Celery, signals

import asynclock
from asynclock_celery import LockedTask, locked
from tests.support.worker import fenced_write

BROKER = os.environ.get("ALT_BROKER", "memory://")
EVENTS = os.environ.get("ALT_EVENTS", "")
TTL = float(os.environ.get("ALT_TTL", "1.0"))

app = Celery("asynclock_tests", broker=BROKER, backend=os.environ.get("ALT_RESULTS") or None)
app.conf.update(
    asynclock_url=os.environ.get("ALT_LOCK_URL") or None,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("ALT_VISIBILITY"):
    # A short broker visibility timeout (acks_late redelivery), swept every second.
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["ALT_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }


def emit(**event: Any) -> None:
    """Push an event for the test (a Redis list named by ALT_EVENTS)."""
    redis.Redis.from_url(EVENTS).rpush("events", json.dumps({"pid": os.getpid(), **event}))


def wait_for_go(key: str, timeout: float = 30.0) -> None:
    """Block until the test pushes to ``go:<key>`` (BLPOP: a real blocking socket read)."""
    redis.Redis.from_url(EVENTS, socket_timeout=timeout + 10).blpop([f"go:{key}"], timeout=timeout)


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    if EVENTS:
        emit(event="worker_ready")


@app.task(bind=True, base=LockedTask, lock="acct:{account}", lock_ttl=TTL, on_busy="retry")
def ledger(self: LockedTask, account: int, writer: str, freeze: bool = False) -> int:
    """The stale-holder scenario: write through the fence; ``freeze`` stops this process
    right after a first write, then replays the write that was in flight (SIGUSR2 blocked,
    as if the write were inside a C call) and reports what the fence said."""
    fence_db = os.environ["ALT_FENCE_DB"]
    token = self.request.fencing_token
    assert token == self.lease.token == asynclock.current_lease().token
    emit(event="started", writer=writer, token=token, task_id=self.request.id)
    if not freeze:
        assert fenced_write(fence_db, f"acct:{account}", token, writer) == "accepted"
        return int(token)
    assert fenced_write(fence_db, f"acct:{account}", token, f"{writer}-before-pause") == (
        "accepted"
    )
    emit(event="freezing", writer=writer, token=token)
    os.kill(os.getpid(), signal.SIGSTOP)  # a GC pause, right before the next write
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        result = fenced_write(fence_db, f"acct:{account}", token, f"{writer}-after-pause")
        emit(event="late_write", writer=writer, result=result)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    time.sleep(30)  # LeaseLost arrives here at the latest
    return int(token)


@app.task(bind=True, base=LockedTask, lock="swallow:{key}", lock_ttl=TTL)
def swallow(self: LockedTask, key: str) -> str:
    """Catches LeaseLost and returns as if nothing happened: the run must still fail."""
    emit(event="started", key=key, token=self.lease.token)
    try:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(30)
    except asynclock.LeaseLost as lost:
        emit(event="swallowed", key=key, reason=lost.reason, at=time.monotonic())
    return "finished as if the lock were held"


@app.task(bind=True, base=LockedTask, lock="hold:{key}", lock_ttl=TTL)
def hold(self: LockedTask, key: str) -> int:
    """Hold ``hold:<key>`` until the test says go."""
    emit(event="holding", key=key, token=self.lease.token)
    wait_for_go(key)
    return int(self.lease.token)


def _busy_body(key: str) -> str:
    emit(event="ran", key=key, token=asynclock.current_lease().token)
    return "ran"


@app.task(base=LockedTask, lock="hold:{key}", lock_ttl=TTL, on_busy="skip")
def busy_skip(key: str) -> str:
    return _busy_body(key)


@app.task(base=LockedTask, lock="hold:{key}", lock_ttl=TTL, on_busy="fail")
def busy_fail(key: str) -> str:
    return _busy_body(key)


@app.task(
    bind=True, base=LockedTask, lock="hold:{key}", lock_ttl=TTL, on_busy="retry", max_retries=20
)
def busy_retry(self: LockedTask, key: str) -> int:
    _busy_body(key)
    return int(self.request.retries)


def _one_at_a_time(key: str) -> int:
    """Hold the body 0.2 s; ``inside:<key>`` counts the runs in their body at once."""
    client = redis.Redis.from_url(EVENTS)
    inside = int(client.incr(f"inside:{key}"))
    try:
        time.sleep(0.2)  # the work the lock protects
    finally:
        client.decr(f"inside:{key}")
    return inside


@app.task(bind=True, base=LockedTask, lock="crowd:{key}", lock_ttl=6)
def crowd(self: LockedTask, key: str, n: int) -> int:
    """Issue 21 item 2: many runs of one key, every option but the ttl at its default."""
    inside = _one_at_a_time(key)
    emit(event="crowd", key=key, n=n, inside=inside, retries=self.request.retries)
    return inside


# Issue 21 item 1: runs against a lock server in its restart grace, one per on_busy policy
# (``max_retries=0``: a grace must not use up the retries meant for contention). With no
# restart_grace option the grace is the first ttl asked for: long enough that a worker
# started on a fresh server meets it.
GRACE_TTL = 10.0


def _fresh_task(on_busy: str | None) -> Any:
    options: dict[str, Any] = {} if on_busy is None else {"on_busy": on_busy, "max_retries": 0}

    def fresh(self: LockedTask, key: str) -> list[int]:
        return [int(self.lease.token), int(self.request.retries)]

    name = f"{__name__}.fresh_{on_busy or 'default'}"
    lock = {"lock": "fresh:{key}", "lock_ttl": GRACE_TTL}
    return app.task(bind=True, base=LockedTask, name=name, **lock, **options)(fresh)


fresh_default = _fresh_task(None)
fresh_retry = _fresh_task("retry")
fresh_skip = _fresh_task("skip")
fresh_fail = _fresh_task("fail")


@app.task(base=LockedTask, lock="survive:{key}", lock_ttl=TTL)
def survivor(key: str, n: int) -> int:
    """Runs of one key across a kill -9 and restart of the lock server, default options."""
    inside = _one_at_a_time(key)
    emit(event="survivor", key=key, n=n, inside=inside)
    return inside


@app.task(bind=True, base=LockedTask, lock="report:{customer_id}:{region}", lock_ttl=TTL)
def report(self: LockedTask, customer_id: int, region: str = "eu") -> str:
    return str(self.lease.name)


@app.task(base=LockedTask, lock="async:{account}", lock_ttl=TTL)
async def async_account(account: int, freeze: bool = False) -> list[Any]:
    lease = asynclock.current_lease()
    if freeze:
        emit(event="started", account=account, token=lease.token)
        os.kill(os.getpid(), signal.SIGSTOP)
        import anyio

        await anyio.sleep(30)  # cancelled on loss
    return [lease.name, lease.token]


@app.task
@locked("plain:{key}", ttl=TTL)
@locked("second:{key}:{extra}", ttl=TTL)
def plain_locked(key: str, extra: int = 0) -> str:
    """Two stacked @locked on a task with the default base; the innermost is current."""
    return str(asynclock.current_lease().name)


@app.task(bind=True, base=LockedTask, lock="limit:{key}", lock_ttl=30.0, soft_time_limit=0.5)
def soft_limited(self: LockedTask, key: str) -> None:
    """Celery's soft time limit (SIGUSR1) ends the body; the lock is released at once."""
    emit(event="started", key=key, token=self.lease.token)
    time.sleep(30)


@app.task(bind=True, base=LockedTask, lock="limit:{key}", lock_ttl=2.0, time_limit=1.0)
def hard_limited(self: LockedTask, key: str) -> None:
    """Celery's hard time limit kills the child; the lock expires by its ttl."""
    emit(event="started", key=key, token=self.lease.token)
    time.sleep(30)


@app.task(bind=True, base=LockedTask, lock="long:{key}", lock_ttl=30.0)
def hold_long(self: LockedTask, key: str) -> int:
    """Like hold, with a ttl long enough that only a release frees it during a test."""
    emit(event="holding", key=key, token=self.lease.token)
    wait_for_go(key)
    return int(self.lease.token)


@app.task(base=LockedTask, lock="long:{key}", lock_ttl=30.0, soft_time_limit=1.0)
def wait_limited(key: str) -> None:
    """Waits (on_busy="wait") behind hold_long until its soft time limit ends the wait."""
    emit(event="ran", key=key)


@app.task(bind=True, base=LockedTask, lock="spin:{key}", lock_ttl=TTL)
def spin_swallow(self: LockedTask, key: str) -> str:
    """For the threads pool: a pure-Python loop (an async exception cannot interrupt a
    blocking call), which catches LeaseLost; the run must still fail."""
    main = threading.current_thread() is threading.main_thread()
    emit(event="started", key=key, token=self.lease.token, main_thread=main)
    try:
        os.kill(os.getpid(), signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
    except asynclock.LeaseLost as lost:
        emit(event="swallowed", key=key, reason=lost.reason, at=time.monotonic())
    return "finished as if the lock were held"


@app.task(
    bind=True,
    base=LockedTask,
    lock="redeliver:{key}",
    lock_ttl=TTL,
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=20,
)
def redelivered(self: LockedTask, key: str) -> int:
    """acks_late: the first run's child is killed while it holds the lock; the message is
    delivered again and that run takes the lock (after the dead run's ttl) and writes."""
    token = int(self.lease.token)
    first = bool(redis.Redis.from_url(EVENTS).set(f"first:{key}", "1", nx=True))
    emit(event="started", key=key, token=token, first=first)
    if first:
        wait_for_go(key)  # killed here by the test
    result = fenced_write(os.environ["ALT_FENCE_DB"], f"redeliver:{key}", token, f"run-{key}")
    assert result == "accepted"
    return token


@signals.task_retry.connect
def _retried(request: Any = None, **_: Any) -> None:
    if EVENTS and request is not None:
        emit(event="retry", task_id=request.id)


# -- idempotent tasks (issue 24): ``runs:<key>`` counts the bodies that ran -------------------


class PermanentDecline(Exception):
    """A failure the charge task stores (idempotency_store_errors): replayed, not retried."""


def count_run(key: str) -> int:
    return int(redis.Redis.from_url(EVENTS).incr(f"runs:{key}"))


@app.task(
    bind=True,
    base=LockedTask,
    idempotent=True,
    idempotency_key="charge:{order}",
    idempotency_fingerprint=("amount",),
    idempotency_store_errors=(PermanentDecline,),
    lock_ttl=TTL,
)
def charge(self: LockedTask, order: str, amount: int, fail: str = "") -> dict[str, Any]:
    """``fail="once"``: the first run raises (the key is freed: a re-sent run runs);
    ``fail="decline"``: a stored failure."""
    n = count_run(f"charge:{order}")
    emit(event="charged", order=order, amount=amount, n=n, token=self.lease.token)
    if fail == "once" and n == 1:
        raise RuntimeError("the payment provider timed out")
    if fail == "decline":
        raise PermanentDecline(f"card declined for order {order}")
    return {"order": order, "amount": amount, "token": self.lease.token}


@app.task(
    bind=True,
    base=LockedTask,
    idempotent=True,
    idempotency_key="frozen:{order}",
    idempotency_fingerprint=(),
    lock_ttl=TTL,
)
def frozen_charge(self: LockedTask, order: str, freeze: bool = False) -> list[Any]:
    """``freeze``: the run stops (SIGSTOP) in its body, past its lease, then returns."""
    token = int(self.lease.token)
    n = count_run(f"frozen:{order}")
    emit(event="frozen_started", order=order, n=n, token=token)
    if freeze:
        os.kill(os.getpid(), signal.SIGSTOP)
        return ["first", token]
    return ["second", token]


@app.task(base=LockedTask, idempotent=True, idempotency_key="held:{key}", lock_ttl=TTL)
def held_job(key: str) -> str:
    """Runs the key's operation until the test says go."""
    count_run(f"held:{key}")
    emit(event="holding", key=key)
    wait_for_go(key)
    return f"done {key}"


@app.task(
    base=LockedTask,
    idempotent=True,
    idempotency_key="held:{key}",
    lock_ttl=TTL,
    on_busy="retry",
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=0.5,
    max_retries=100,
)
def retried_job(key: str) -> str:
    """The same key, on_busy="retry": retried while held_job runs, then replays."""
    count_run(f"held:{key}")
    return "ran the body again"


def _slow_body(key: str) -> int:
    """The first run blocks until the test says go (so the broker redelivers it meanwhile);
    a later run returns at once (it would otherwise be redelivered again, and again)."""
    n = count_run(key)
    emit(event="body", key=key, n=n)
    if n == 1:
        wait_for_go(key)
    return n


@app.task(acks_late=True)
def slow_plain(key: str) -> int:
    """A plain acks_late task: every delivery runs the body."""
    return _slow_body(key)


@app.task(base=LockedTask, idempotent=True, acks_late=True, lock_ttl=TTL)
def slow_idempotent(key: str) -> int:
    """The same, idempotent (key: the task's name and its arguments)."""
    return _slow_body(key)


@app.task(base=LockedTask, idempotent=True, lock_ttl=2.0)
def defaults(key: str, amount: int) -> list[Any]:
    """Every idempotency option at its default (lock_ttl is short only because a fresh
    lock server's restart grace is the first ttl asked for)."""
    n = count_run(f"defaults:{key}")
    emit(event="defaults", key=key, n=n)
    return [key, amount, asynclock.current_lease().token]


@signals.task_prerun.connect
def _prerun(task_id: str = "", task: Any = None, **_: Any) -> None:
    if EVENTS and task is not None and task.name.endswith(("slow_plain", "slow_idempotent")):
        emit(event="prerun", task_id=task_id)


@signals.task_postrun.connect
def _postrun(task_id: str = "", task: Any = None, state: str = "", **_: Any) -> None:
    if EVENTS and task is not None and task.name.endswith(("slow_plain", "slow_idempotent")):
        replayed = getattr(task.request, "idempotency_replayed", None)
        emit(event="postrun", task_id=task_id, state=state, replayed=replayed)


# Issue 42 item 5: at most LIMITED_LIMIT runs of one key at once across every worker.
LIMITED_LIMIT = 2


@app.task(bind=True, base=LockedTask, lock="limited:{key}", lock_limit=LIMITED_LIMIT, lock_ttl=6)
def limited(self: LockedTask, key: str, n: int) -> list[int]:
    """Hold one of LIMITED_LIMIT permits 0.5 s; ``inside:<key>`` counts the runs in their
    body at once (and the most ever seen, ``most:<key>``)."""
    permit = self.permit
    assert asynclock.current_lease() is permit.lease
    assert self.request.fencing_token == permit.token
    client = redis.Redis.from_url(EVENTS)
    inside = int(client.incr(f"inside:{key}"))
    client.rpush(f"most:{key}", inside)
    try:
        time.sleep(0.5)
    finally:
        client.decr(f"inside:{key}")
    emit(event="limited", key=key, n=n, inside=inside, slot=permit.slot, token=permit.token)
    return [inside, permit.slot, permit.token]


@app.task(base=LockedTask, lock="limited-skip:{key}", lock_limit=1, on_busy="skip", lock_ttl=6)
def limited_skip(key: str) -> str:
    emit(event="limited_skip_started", key=key)
    wait_for_go(key)
    return "ran"
