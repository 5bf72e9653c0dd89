"""Idempotency keys (docs/idempotency.md) on every backend that stores records, against
real servers: run once, replay, wait or InProgress, fenced results, stored failures,
fingerprints, expiry, bad input; and Redlock's refusal."""

from __future__ import annotations

import contextlib
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing
from asynclock._core import idempotency
from asynclock._core.idempotency_rules import KEY_NAMESPACE, lock_name
from asynclock.backends.etcd import _proto as pb
from asynclock.backends.etcd.client import prefix_end
from asynclock.backends.etcd.driver import EtcdDriver
from asynclock.backends.zookeeper._paths import lock_path as zk_lock_path
from asynclock.idempotency import MAX_DEPTH, MAX_RESULT_BYTES
from tests.support.procs import start_worker
from tests.support.redis_servers import RedisFactory
from tests.support.spec import BackendSpec, backends_with

pytestmark = pytest.mark.anyio

#: Every backend that stores idempotency records (Redlock refuses: see the last test).
RECORD_BACKENDS = backends_with("records")


@pytest.fixture(params=RECORD_BACKENDS)
def idem_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.fixture
async def backend(idem_spec: BackendSpec) -> AsyncIterator[asynclock.Backend]:
    async with idem_spec.connect() as b:
        yield b


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    return f"idem:{request.node.name}:{uuid.uuid4().hex[:8]}"


async def end_lease_at_server(spec: BackendSpec, backend: asynclock.Backend, key: str) -> None:
    """End the key's lease at the server behind its holder's back (``spec.sabotage``; for
    etcd, whose sabotage passes the name to etcdctl's argv, where a NUL cannot go, a
    delete of the lock's keys through the raw etcd client)."""
    driver = backend.driver
    if isinstance(driver, EtcdDriver):
        prefix = driver.lock_prefix(lock_name(key))
        delete = pb.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix))
        await driver.client.txn(pb.TxnRequest(success=[pb.RequestOp(request_delete_range=delete)]))
    else:
        await spec.sabotage(backend, lock_name(key))


class Boom(Exception):
    pass


async def done() -> str:
    return "done"


# -- run once, replay -------------------------------------------------------------------------


async def test_first_call_runs_under_a_renewed_lease_and_later_calls_replay(
    backend: asynclock.Backend, key: str
) -> None:
    with anyio.fail_after(10):
        async with backend.idempotent(key, ttl=5.0) as op:
            assert not op.replayed
            # The record's hold is an ordinary lease of this backend's one session, on the
            # key's name in asynclock's own namespace.
            assert [lease.name for lease in backend.held()] == [KEY_NAMESPACE + key]
            assert op.lease is backend.held()[0]
            assert op.token == op.lease.token
            await op.save({"charged": 42, "id": "ch_1"})
        assert backend.held() == []
        async with backend.idempotent(key, ttl=5.0) as again:
            assert again.replayed
            assert again.result == {"charged": 42, "id": "ch_1"}
            assert again.token == op.token
            assert again.lease is None


async def test_run_calls_the_function_once(backend: asynclock.Backend, key: str) -> None:
    calls: list[int] = []

    async def charge(amount: int) -> dict[str, int]:
        calls.append(amount)
        return {"amount": amount}

    with anyio.fail_after(10):
        first = await backend.idempotent(key, ttl=5.0).run(charge, 7)
        second = await backend.idempotent(key, ttl=5.0).run(charge, 7)
    assert first == second == {"amount": 7}
    assert calls == [7]


async def test_decorator_keys_and_fingerprints_from_arguments(
    backend: asynclock.Backend, key: str
) -> None:
    calls: list[tuple[str, int]] = []

    @backend.idempotent_function(key + ":{order_id}", ttl=5.0, fingerprint=("amount",))
    async def pay(order_id: str, amount: int, note: str = "") -> str:
        calls.append((order_id, amount))
        return f"paid {order_id} {amount}"

    with anyio.fail_after(10):
        assert await pay("o1", 10) == "paid o1 10"
        assert await pay("o1", 10, note="again") == "paid o1 10"  # not fingerprinted
        assert await pay("o2", 10) == "paid o2 10"
        with pytest.raises(asynclock.IdempotencyKeyReused):
            await pay("o1", 11)
    assert calls == [("o1", 10), ("o2", 10)]


async def test_body_without_save_stores_none(backend: asynclock.Backend, key: str) -> None:
    with anyio.fail_after(10):
        async with backend.idempotent(key, ttl=5.0) as op:
            assert not op.replayed
        async with backend.idempotent(key, ttl=5.0) as op:
            assert op.replayed and op.result is None


# -- concurrent callers ---------------------------------------------------------------------


async def test_concurrent_duplicates_run_the_body_once(
    backend: asynclock.Backend, key: str
) -> None:
    runs = 0
    results: list[object] = []

    async def body() -> str:
        nonlocal runs
        runs += 1
        await anyio.sleep(0.05)  # others arrive while it runs
        return "the result"

    async def caller() -> None:
        results.append(await backend.idempotent(key, ttl=5.0, wait=20).run(body))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(caller)
    assert runs == 1
    assert results == ["the result"] * 10


async def test_waiting_duplicates_in_one_process_replay_what_the_first_stored(
    backend: asynclock.Backend, key: str
) -> None:
    """Duplicates with ``wait=`` in one process wait for the one call of the key that
    holds its lock and replay what it stored (a different fingerprint is still refused);
    a stored failure is replayed to them as a failure."""
    started = anyio.Event()
    proceed = anyio.Event()
    outcomes: list[object] = []

    async def first(result: object) -> None:
        async with backend.idempotent(key, ttl=5.0, wait=10, fingerprint=1) as op:
            started.set()
            await proceed.wait()
            await op.save(result)

    async def duplicate(fingerprint: int) -> None:
        try:
            async with backend.idempotent(key, ttl=5.0, wait=10, fingerprint=fingerprint) as op:
                outcomes.append(("replayed" if op.replayed else "ran", op.result))
        except asynclock.IdempotencyKeyReused:
            outcomes.append("reused")

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first, {"paid": 42})
            await started.wait()
            for fingerprint in (1, 1, 2):
                tg.start_soon(duplicate, fingerprint)
            await anyio.wait_all_tasks_blocked()
            proceed.set()
    assert sorted(map(str, outcomes)) == sorted(
        map(str, [("replayed", {"paid": 42}), ("replayed", {"paid": 42}), "reused"])
    )


async def test_in_progress_without_wait(backend: asynclock.Backend, key: str) -> None:
    with anyio.fail_after(10):
        async with backend.idempotent(key, ttl=5.0, fingerprint={"a": 1}) as op:
            assert not op.replayed

            async def other() -> None:
                with pytest.raises(asynclock.InProgress) as info:
                    async with backend.idempotent(key, ttl=5.0, fingerprint={"a": 1}):
                        raise AssertionError("must not run")  # pragma: no cover
                assert info.value.key == key and info.value.waited is None
                assert "wait=" in str(info.value)
                # Another fingerprint while it runs: the key is reused.
                with pytest.raises(asynclock.IdempotencyKeyReused):
                    async with backend.idempotent(key, ttl=5.0, fingerprint={"a": 2}):
                        raise AssertionError("must not run")  # pragma: no cover

            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
            await op.save(1)


async def test_waiter_times_out_with_in_progress(backend: asynclock.Backend, key: str) -> None:
    with anyio.fail_after(10):
        async with backend.idempotent(key, ttl=5.0):

            async def other() -> None:
                with pytest.raises(asynclock.InProgress) as info:
                    await backend.idempotent(key, ttl=5.0, wait=0.2).run(anyio.sleep, 0)
                assert info.value.waited == 0.2

            async with anyio.create_task_group() as tg:
                tg.start_soon(other)


async def test_waiter_runs_the_body_when_the_first_fails_retryably(
    backend: asynclock.Backend, key: str
) -> None:
    started = anyio.Event()
    proceed = anyio.Event()

    async def first() -> None:
        with pytest.raises(Boom):
            async with backend.idempotent(key, ttl=5.0):
                started.set()
                await proceed.wait()
                raise Boom("card declined: retry")

    async def second() -> str:
        return "second ran"

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await started.wait()
            waiter = backend.idempotent(key, ttl=5.0, wait=10)
            proceed.set()
            assert await waiter.run(second) == "second ran"
        assert await backend.idempotent(key, ttl=5.0).run(second) == "second ran"


# -- failures --------------------------------------------------------------------------------


async def test_a_failure_frees_the_key_for_a_retry(backend: asynclock.Backend, key: str) -> None:
    async def fail() -> str:
        raise Boom("transient")

    async def succeed() -> str:
        return "ok"

    with anyio.fail_after(10):
        with pytest.raises(Boom):
            await backend.idempotent(key, ttl=5.0).run(fail)
        assert await backend.idempotent(key, ttl=5.0).run(succeed) == "ok"
        assert await backend.idempotent(key, ttl=5.0).run(fail) == "ok"  # replayed


async def test_store_errors_are_stored_and_replayed(backend: asynclock.Backend, key: str) -> None:
    calls = 0

    async def fail() -> None:
        nonlocal calls
        calls += 1
        raise Boom("insufficient funds")

    with anyio.fail_after(10):
        with pytest.raises(Boom):
            await backend.idempotent(key, ttl=5.0, store_errors=(Boom,)).run(fail)
        with pytest.raises(asynclock.ReplayedFailure) as info:
            await backend.idempotent(key, ttl=5.0, store_errors=(Boom,)).run(fail)
    assert calls == 1
    assert info.value.error_type == f"{__name__}.Boom"
    assert info.value.message == "insufficient funds"
    assert info.value.key == key
    assert "insufficient funds" in str(info.value)


def nested(depth: int) -> list[Any]:
    """A list nested ``depth`` levels deep (built without recursion)."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("result", "error", "words"),
    [
        ({1, 2}, TypeError, "JSON-serialisable"),
        (float("nan"), TypeError, "JSON-serialisable"),
        ("x" * MAX_RESULT_BYTES, ValueError, "at most 65536"),
        # JSON would turn 1 into "1": the two keys would come back as one entry.
        ({1: "int key", "1": "str key"}, TypeError, r"dict key 1 \(int\) in result:"),
        ([{"a": {True: 1}}], TypeError, r"dict key True \(bool\) in result\[0\]\['a'\]"),
        # Deeper than the bound: the documented ValueError, never a RecursionError.
        (nested(50_000), ValueError, "more than 100 levels deep"),
        (nested(MAX_DEPTH + 1), ValueError, "more than 100 levels deep"),
        ([0] * (MAX_RESULT_BYTES + 1), ValueError, "more than 65536 values"),
    ],
    ids=["set", "nan", "too-large", "int-key", "bool-key", "deep-50000", "deep-101", "values"],
)
async def test_a_result_that_cannot_be_stored_is_rejected_before_storing(
    backend: asynclock.Backend, key: str, result: object, error: type[Exception], words: str
) -> None:
    async def bad() -> object:
        return result

    async def good() -> str:
        return "retried"

    with anyio.fail_after(10):
        with pytest.raises(error, match=words):
            # Even listed in store_errors, a rejected result is not stored as a failure.
            await backend.idempotent(key, ttl=5.0, store_errors=(error,)).run(bad)
        assert await backend.idempotent(key, ttl=5.0).run(good) == "retried"


async def test_a_result_as_deep_as_the_bound_replays_as_it_was(
    backend: asynclock.Backend, key: str
) -> None:
    deepest = {"a": nested(MAX_DEPTH - 1), "b": [1.5, "é", None, True]}
    with anyio.fail_after(10):
        assert await backend.idempotent(key, ttl=5.0).run(_value, deepest) == deepest
        async with backend.idempotent(key, ttl=5.0) as op:
            assert op.replayed and op.result == deepest


async def _value(value: object) -> object:
    return value


class Declined(Exception):
    """An outcome the tests store (``store_errors``)."""


REFUSED = {1: "int key", "1": "str key"}  # save() refuses it: TypeError


async def _saves_then(op: asynclock.IdempotentCall, error: BaseException) -> None:
    await op.save("saved")
    raise error


async def _refused(op: asynclock.IdempotentCall) -> None:
    await op.save(REFUSED)


async def _refused_caught(op: asynclock.IdempotentCall, then: object = None) -> None:
    with pytest.raises(TypeError):
        await op.save(REFUSED)
    if then is not None:
        await op.save(then)


async def _nothing(op: asynclock.IdempotentCall) -> None:
    pass


async def _raise(op: asynclock.IdempotentCall, error: BaseException) -> None:
    raise error


#: docs/idempotency.md, "What a body leaves behind": each row, as (the body, what its
#: call raises, what the next call of the key finds). Every call stores Declined and
#: TypeError (store_errors), to show a refused result is never stored as a failure.
BODY_ROWS: dict[str, tuple[Any, type[BaseException] | None, tuple[str, object]]] = {
    "saves": (lambda op: op.save("saved"), None, ("replay", "saved")),
    "ends-without-saving": (_nothing, None, ("replay", None)),
    "raises": (lambda op: _raise(op, Boom("x")), Boom, ("runs", None)),
    "raises-a-store-error": (lambda op: _raise(op, Declined("x")), Declined, ("failure", None)),
    "raises-after-saving": (lambda op: _saves_then(op, Boom("x")), Boom, ("replay", "saved")),
    "raises-a-store-error-after-saving": (
        lambda op: _saves_then(op, Declined("x")),
        Declined,
        ("replay", "saved"),
    ),
    "save-refused": (_refused, TypeError, ("runs", None)),
    "save-refused-and-caught": (_refused_caught, None, ("runs", None)),
    "save-refused-then-another-saved": (
        lambda op: _refused_caught(op, "other"),
        None,
        ("replay", "other"),
    ),
}


@pytest.mark.parametrize("row", list(BODY_ROWS))
async def test_what_a_body_leaves_behind(backend: asynclock.Backend, key: str, row: str) -> None:
    body, raised, (found, value) = BODY_ROWS[row]
    stored = (Declined, TypeError)
    with anyio.fail_after(10):
        if raised is None:
            async with backend.idempotent(key, ttl=5.0, store_errors=stored) as op:
                assert not op.replayed
                await body(op)
        else:
            with pytest.raises(raised):
                async with backend.idempotent(key, ttl=5.0, store_errors=stored) as op:
                    await body(op)
        assert backend.held() == []  # the key's lease is released whatever the body did
        if found == "failure":
            with pytest.raises(asynclock.ReplayedFailure, match="Declined"):
                await backend.idempotent(key, ttl=5.0, store_errors=stored).run(done)
            return
        async with backend.idempotent(key, ttl=5.0, store_errors=stored) as again:
            assert (again.replayed, again.result) == (found == "replay", value), row


async def test_fingerprint_mismatch_after_completion(backend: asynclock.Backend, key: str) -> None:
    with anyio.fail_after(10):
        await backend.idempotent(key, ttl=5.0, fingerprint={"amount": 10}).run(anyio.sleep, 0)
        with pytest.raises(asynclock.IdempotencyKeyReused, match="different arguments"):
            await backend.idempotent(key, ttl=5.0, fingerprint={"amount": 11}).run(anyio.sleep, 0)
        # Key order does not matter (canonical JSON); no fingerprint: not checked.
        async with backend.idempotent(key, ttl=5.0, fingerprint={"amount": 10}) as op:
            assert op.replayed
        async with backend.idempotent(key, ttl=5.0) as op:
            assert op.replayed


async def test_a_record_expires_after_keep(backend: asynclock.Backend, key: str) -> None:
    runs: list[int] = []

    async def body() -> int:
        runs.append(1)
        return len(runs)

    with anyio.fail_after(15):
        assert await backend.idempotent(key, ttl=5.0, keep=1.0).run(body) == 1
        assert await backend.idempotent(key, ttl=5.0, keep=1.0).run(body) == 1
        # The record's expiry is the server's; poll until it is gone (keep is 1 s).
        for _ in range(100):
            if await backend.idempotent(key, ttl=5.0, keep=1.0).run(body) != 1:
                break
            await anyio.sleep(0.1)
    assert runs == [1, 1]


# -- fencing -----------------------------------------------------------------------------------


async def test_a_holder_whose_lease_ended_cannot_overwrite_its_successor(
    idem_spec: BackendSpec, key: str
) -> None:
    """A holder presumed dead (its lease ended at the server while it still ran) saves
    late: StaleToken, and its successor's result stays."""
    with anyio.fail_after(15):
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(idem_spec.connect())
            # memory:// keeps its locks in one backend object: the successor shares it.
            b = (
                a
                if not idem_spec.multiprocess
                else await stack.enter_async_context(idem_spec.connect())
            )
            checked = False
            with pytest.raises(asynclock.LeaseLost):
                async with a.idempotent(key, ttl=6.0) as slow:
                    # Shielded from its own loss, as a frozen process or code that cannot
                    # be cancelled is (else its renewal could cancel it before it saves).
                    with anyio.CancelScope(shield=True):
                        # Its lease ends at the server behind its back (as when frozen
                        # past its ttl).
                        await end_lease_at_server(idem_spec, a, key)

                        async def successor() -> None:  # another task (as another process)
                            async with b.idempotent(key, ttl=5.0) as op:
                                assert not op.replayed
                                assert op.token > slow.token
                                await op.save("successor")

                        async with anyio.create_task_group() as tg:
                            tg.start_soon(successor)
                        with pytest.raises(asynclock.StaleToken) as info:
                            await slow.save("slow")
                        assert info.value.token == slow.token
                        assert "nothing was written" in str(info.value)
                        checked = True
                    assert slow.lease is not None
                    await slow.lease.lost  # its renewal is refused: cancelled
            assert checked
            async with b.idempotent(key, ttl=5.0) as op:
                assert op.replayed and op.result == "successor"


async def test_lease_loss_cancels_the_body_and_stores_nothing(
    idem_spec: BackendSpec, key: str
) -> None:
    with anyio.fail_after(15):
        async with idem_spec.connect(heartbeat=0.05) as backend:
            with pytest.raises(asynclock.LeaseLost):
                async with backend.idempotent(key, ttl=2.0) as op:
                    await end_lease_at_server(idem_spec, backend, key)
                    await anyio.sleep_forever()  # cancelled by the loss
            assert op.lease is not None and op.lease.lost
            assert await backend.idempotent(key, ttl=5.0).run(done) == "done"
            async with backend.idempotent(key, ttl=5.0) as again:
                assert again.replayed and again.token > op.token


async def test_a_save_after_the_loss_without_an_await_between_stores_nothing(
    idem_spec: BackendSpec, key: str
) -> None:
    """The loss lands while the body is in code that cannot be cancelled (a thread, a
    shielded call): its next ``save()`` is cancelled before anything is sent, on every
    driver, also one whose write starts without yielding (SQLite stored it)."""
    with anyio.fail_after(15):
        async with idem_spec.connect() as backend:
            with pytest.raises(asynclock.LeaseLost):
                async with backend.idempotent(key, ttl=5.0) as op:
                    asynclock.testing.force_loss(op)
                    await op.save("late")
            assert await backend.idempotent(key, ttl=5.0).run(done) == "done"


async def test_a_store_that_goes_away_mid_body_cancels_it_and_stores_nothing(
    redis_factory: RedisFactory, key: str
) -> None:
    """The Redis server is killed while the body runs: the renewal fails, the body is
    cancelled (LeaseLost); back up (with its data), the key is free and the body runs."""
    server = redis_factory(persist=True)
    async with asynclock.connect(server.url, heartbeat=0.1) as backend:
        with anyio.fail_after(15):
            with pytest.raises(asynclock.LeaseLost):
                async with backend.idempotent(key, ttl=1.0) as op:
                    server.kill()
                    await anyio.sleep_forever()  # cancelled by the loss
            assert not op.saved
            server.start(settle=False)  # the same data (append-only file): no grace
            assert await backend.idempotent(key, ttl=5.0, wait=10).run(done) == "done"


async def test_a_redis_restart_without_persistence_forgets_results_and_says_so(
    redis_factory: RedisFactory, key: str
) -> None:
    """As a user deploys it by default: a Redis server without persistence, just started,
    restarted mid-way with its data lost. The stored result is gone with the data, so the
    operation runs again, but only after the restart grace (a run still going from before
    the restart could otherwise overlap with it): never a replay of nothing, never at once."""
    server = redis_factory(fresh=True)  # documented defaults: no persistence, no settling
    runs: list[int] = []

    async def charge() -> str:
        runs.append(1)
        return "charged"

    async with asynclock.connect(server.url) as backend:
        with anyio.fail_after(20):
            # A just-started server: the first call waits out its grace, then runs once.
            assert await backend.idempotent(key, ttl=1.0, wait=10).run(charge) == "charged"
            assert await backend.idempotent(key, ttl=1.0, wait=10).run(charge) == "charged"
            assert len(runs) == 1
            server.restart(keep_data=False)
            # The grace ends the first asker's ttl after the server started: 4 s, so this
            # call lands inside it even on a loaded machine (with 1 s, a restart that took
            # over a second to reconnect found the grace over and ran at once, correctly).
            with pytest.raises(asynclock.RestartGrace):
                await backend.idempotent(key, ttl=4.0).run(charge)
            assert len(runs) == 1  # not run during the grace
            assert await backend.idempotent(key, ttl=4.0, wait=10).run(charge) == "charged"
            assert len(runs) == 2  # the record went with the data: it ran again


@pytest.fixture(params=["sqlite", "postgres", "redis", "etcd"])
def shared_idem_spec(request: pytest.FixtureRequest) -> BackendSpec:
    """Backends that several processes share (one of each way to fence a record)."""
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.mark.parametrize("shield", [True, False], ids=["stale", "lost-first"])
async def test_a_frozen_holder_is_replaced_and_its_late_save_stores_nothing(
    shared_idem_spec: BackendSpec, key: str, shield: bool
) -> None:
    """SIGSTOP a real process holding the key past its ttl: the key is taken over after
    the ttl, the body runs once more with a larger token, and the frozen one's late save
    stores nothing, as documented ("A late save()"):

    * ``stale``: a body that cannot be cancelled there (shielded) sends the write; the
      server refuses it (StaleToken), then the block raises LeaseLost;
    * ``lost-first``, the usual case: the lease is lost as the process resumes, past its
      local deadline, so the save is cancelled before it is sent; the block raises
      LeaseLost. (The save is asked for once the worker has reported the loss: the order
      the usual case has, made certain.)
    """
    spec = shared_idem_spec
    worker = await start_worker(
        spec, mode="idem", key=key, ttl=0.6, result="frozen", shield=shield, report_loss=not shield
    )
    first = await worker.expect("acquired")
    worker.signal(signal.SIGSTOP)
    try:
        async with spec.connect() as backend:
            with anyio.fail_after(20):
                async with backend.idempotent(key, ttl=5.0, wait=15) as op:
                    assert not op.replayed and op.token > first["token"]
                    await op.save("successor")
                worker.signal(signal.SIGCONT)
                if not shield:
                    await worker.expect("lease_lost")
                await worker.send("save")
                if shield:
                    stale = await worker.expect("stale")
                    assert stale["token"] == first["token"]
                lost = await worker.expect("lost")
                async with backend.idempotent(key, ttl=5.0) as again:
                    assert again.replayed and again.result == "successor"
    finally:
        worker.signal(signal.SIGCONT)
    assert lost["token"] == first["token"]
    assert await worker.wait() == 0


# -- defaults on a fresh server, bad input, the namespace, Redlock ----------------------------


async def test_documented_defaults_on_a_fresh_sqlite_file(tmp_path: Path) -> None:
    async with asynclock.connect(f"sqlite:///{tmp_path / 'fresh.db'}") as backend:
        guard = backend.idempotent("order-1", ttl=5.0)
        assert guard.keep == 86400.0 and guard.wait is None and guard.store_errors == ()
        with anyio.fail_after(10):
            assert await guard.run(done) == "done"
            async with backend.idempotent("order-1", ttl=5.0) as op:
                assert op.replayed and op.token == 1


async def test_documented_defaults_on_a_freshly_started_redis(redis_factory: RedisFactory) -> None:
    """A just-started server grants nothing during its restart grace (the first ttl asked
    for): without ``wait`` that is RestartGrace (not InProgress); with it, the call waits
    through it and runs."""
    server = redis_factory(fresh=True)

    async def body() -> str:
        return "ran"

    async with asynclock.connect(server.url) as backend:
        with anyio.fail_after(15):
            try:
                await backend.idempotent("order-1", ttl=1.0).run(body)
            except asynclock.RestartGrace as exc:
                assert exc.retry_after is not None  # the grace still ran; wait through it
            assert await backend.idempotent("order-1", ttl=1.0, wait=10).run(body) == "ran"
            async with backend.idempotent("order-1", ttl=1.0) as op:
                assert op.replayed and op.result == "ran"
                assert op.token > 0


BAD_KEYS: list[tuple[Any, type[Exception], str]] = [
    (b"k", TypeError, "must be a str, not bytes"),
    ("", ValueError, "must not be empty"),
    ("a\x00b", ValueError, "NUL character at index 1"),
    ("a\ud800", ValueError, "lone surrogate"),
    ("k" * 256, ValueError, "256 UTF-8 bytes long"),
    ("é" * 128, ValueError, "256 UTF-8 bytes long"),
]


@pytest.mark.parametrize(("bad", "error", "words"), BAD_KEYS)
async def test_bad_keys(bad: Any, error: type[Exception], words: str) -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(error, match=words) as info:
            backend.idempotent(bad, ttl=5.0)
        assert "1 to 255 UTF-8 bytes" in str(info.value)
    async with asynclock.connect("memory://") as backend:
        backend.idempotent("k" * 255, ttl=5.0)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"ttl": 0}, ValueError, "ttl must be"),
        ({"ttl": "5"}, TypeError, "ttl must be a number"),
        ({"ttl": 5.0, "keep": 0.5}, ValueError, "keep must be between 1 second"),
        ({"ttl": 5.0, "keep": 31 * 86400}, ValueError, "30 days.*unique constraint"),
        ({"ttl": 5.0, "keep": float("nan")}, ValueError, "NaN"),
        ({"ttl": 5.0, "wait": -1}, ValueError, "wait forever"),
        ({"ttl": 5.0, "wait": "1"}, TypeError, "number of seconds"),
        ({"ttl": 5.0, "fingerprint": {1j}}, TypeError, "JSON-serialisable"),
        ({"ttl": 5.0, "fingerprint": {1: "a"}}, TypeError, r"dict key 1 \(int\) in fingerprint"),
        ({"ttl": 5.0, "fingerprint": nested(50_000)}, ValueError, "more than 100 levels"),
        ({"ttl": 5.0, "store_errors": [ValueError]}, TypeError, "tuple of Exception"),
        ({"ttl": 5.0, "store_errors": (KeyboardInterrupt,)}, TypeError, "Exception subclasses"),
    ],
)
async def test_bad_options(options: dict[str, Any], error: type[Exception], words: str) -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(error, match=words):
            backend.idempotent("k", **options)


async def test_bad_decorations() -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(TypeError, match="async def"):
            backend.idempotent_function("k:{a}", ttl=5.0)(lambda a: a)

        async def f(a: int) -> int:
            return a

        with pytest.raises(TypeError, match="uses b"):
            backend.idempotent_function("k:{b}", ttl=5.0)(f)
        with pytest.raises(TypeError, match="fingerprint names c"):
            backend.idempotent_function("k:{a}", ttl=5.0, fingerprint=("c",))(f)
        with pytest.raises(TypeError, match="tuple of argument names"):
            backend.idempotent_function("k:{a}", ttl=5.0, fingerprint="a")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="keep must be"):
            backend.idempotent_function("k:{a}", ttl=5.0, keep=0.1)


async def test_user_locks_cannot_take_the_namespace(key: str) -> None:
    async with asynclock.connect("memory://") as backend:
        for attempt in (
            lambda: backend.lock(lock_name(key), ttl=5.0),
            lambda: backend.leadership(lock_name(key), ttl=5.0),
        ):
            with pytest.raises(ValueError, match="keeps for its own records"):
                attempt()
        with pytest.raises(ValueError, match="keeps for its own records"):
            await backend.acquire(lock_name(key), ttl=5.0)
        async with backend.lock(key, ttl=5.0):  # the key itself is a name like any other
            assert await backend.idempotent(key, ttl=5.0).run(done) == "done"


async def test_a_key_and_a_longer_key_under_it_never_meet(
    backend: asynclock.Backend, key: str
) -> None:
    """Key ``k`` runs while key ``k/b`` runs (on etcd, lock names share a key prefix, so
    ``k`` was InProgress: an idempotency key's name has no "/"), and each keeps its own
    result."""
    with anyio.fail_after(10):
        async with backend.idempotent(f"{key}/b", ttl=5.0) as inner:
            assert not inner.replayed
            async with backend.idempotent(key, ttl=5.0) as outer:
                assert not outer.replayed
                await outer.save("outer")
            async with backend.idempotent(f"{key}/b/c", ttl=5.0) as deeper:
                await deeper.save("deeper")
            await inner.save("inner")
        for k, expected in ((key, "outer"), (f"{key}/b", "inner"), (f"{key}/b/c", "deeper")):
            async with backend.idempotent(k, ttl=5.0) as op:
                assert op.replayed and op.result == expected


def test_no_key_lays_out_under_another_as_a_path() -> None:
    """Where names become paths (etcd keys ``<name>/<lease>``, ZooKeeper nodes), no key's
    lock is under another key's: one segment each, and no prefix of another."""
    keys = ["a", "a/b", "a/b/c", "ab", "a%2Fb", "/a", "a/", "é/ü"]
    names = [lock_name(k) for k in keys]
    assert len(set(names)) == len(keys)  # one-to-one
    assert all("/" not in name for name in names)
    etcd = [(name + "/").encode("utf-8") for name in names]  # EtcdDriver.lock_prefix
    for one in etcd:
        assert [other for other in etcd if other != one and other.startswith(one)] == []
    for name in names:
        assert zk_lock_path("/asynclock", name).count("/") == 2  # /asynclock/<one node>


async def test_a_record_an_earlier_build_kept_under_a_key_with_a_slash_still_replays(
    backend: asynclock.Backend, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier builds named key ``a/b``'s lock ``...idempotency:a/b``: a result they stored
    there is replayed (and a running record there is not taken for one)."""
    legacy, running = f"{key}/done", f"{key}/running"
    with anyio.fail_after(10):
        with monkeypatch.context() as patch:  # as an earlier build named keys
            patch.setattr(idempotency, "lock_name", lambda k: KEY_NAMESPACE + k)
            patch.setattr(idempotency, "legacy_lock_name", lambda k: None)
            await backend.idempotent(legacy, ttl=5.0).run(_value, "kept before")
            async with backend.idempotent(running, ttl=5.0):
                assert [lease.name for lease in backend.held()] == [KEY_NAMESPACE + running]
                async with backend.idempotent(legacy, ttl=5.0) as op:
                    assert op.replayed and op.result == "kept before"
                # Now: the earlier record of `legacy` still replays; `running` is not done.
                patch.undo()
                async with backend.idempotent(legacy, ttl=5.0) as op:
                    assert op.replayed and op.result == "kept before"
                async with backend.idempotent(running, ttl=5.0) as op:
                    assert not op.replayed


async def test_nested_same_key_in_one_task_is_already_held(key: str) -> None:
    async with asynclock.connect("memory://") as backend:
        async with backend.idempotent(key, ttl=5.0):
            with pytest.raises(asynclock.AlreadyHeld):
                async with backend.idempotent(key, ttl=5.0):
                    pass  # pragma: no cover


async def test_redlock_refuses_with_a_reason(spec_redlock: BackendSpec, key: str) -> None:
    async with spec_redlock.connect() as backend:
        with anyio.fail_after(10), pytest.raises(NotImplementedError, match="majority"):
            await backend.idempotent(key, ttl=5.0).run(anyio.sleep, 0)
