"""Under trio (issue 8, item 8): memory:// and sqlite:// pass the conformance basics (lock,
contention between tasks, loss -> LeaseLost, cancellation); redis://, redlock://,
postgresql:// and etcd:// (their driver libraries run only on asyncio) refuse trio with a clear
RuntimeError at connect(), or at open before any I/O when connect() ran outside the loop.

The conformance tests are reused as they are (called from here, under trio), so the
basics mean the same thing on both event loops."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest
import trio

import asynclock
from tests.conformance import test_cancellation as cancellation
from tests.conformance import test_exclusion as exclusion
from tests.conformance import test_holder_extend_break as gaps
from tests.conformance import test_loss as loss
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    result: str = request.param
    return result


@pytest.fixture(params=["memory", "sqlite"])
def spec(request: pytest.FixtureRequest) -> BackendSpec:
    """The backends that work under trio (overrides the suite's every-backend ``spec``)."""
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.fixture(autouse=True)
def _under_trio(anyio_backend: str) -> None:
    assert anyio_backend == "trio"


async def test_really_under_trio() -> None:
    assert trio.lowlevel.current_trio_token() is not None  # raises outside trio.run


async def test_lock_and_tokens(backend: asynclock.Backend, lock_name: str) -> None:
    async with backend.lock(lock_name, ttl=5.0) as first:
        assert await backend.validate(lock_name, first.token)
        assert first.remaining() > 0 and not first.lost
    await loss.test_released_lease_frees_the_name(backend, lock_name)
    async with backend.lock(lock_name, ttl=5.0) as again:
        assert again.token > first.token


async def test_contention_between_tasks(backend: asynclock.Backend, lock_name: str) -> None:
    with anyio.fail_after(30):
        await exclusion.test_fifty_tasks_never_lose_an_update(backend, lock_name + ":50")
        await exclusion.test_waiter_gets_lock_after_release(backend, lock_name + ":wait")
        await exclusion.test_blocking_false_raises_lock_held(backend, lock_name + ":held")
        await exclusion.test_timeout_raises_acquire_timeout(backend, lock_name + ":timeout")


async def test_refused_renewal_raises_lease_lost(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(30):
        await loss.test_refused_renewal_cancels_within_one_heartbeat(spec, backend, lock_name)


async def test_loss_cancels_child_tasks_and_is_awaitable(
    backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(30):
        await loss.test_work_in_child_tasks_is_cancelled_on_loss(backend, lock_name + ":kids")
        await loss.test_lost_signal_is_awaitable(backend, lock_name + ":signal")
        await loss.test_max_hold_bounds_a_hung_holder(backend, lock_name + ":max_hold")


async def test_cancel_at_every_await_point(spec: BackendSpec, lock_name: str) -> None:
    with anyio.fail_after(50):
        await cancellation.test_cancel_at_every_await_point(spec, lock_name)


async def test_cancelled_waiter_and_holder_leave_the_name_free(
    backend: asynclock.Backend, lock_name: str
) -> None:
    holding = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def holder(*, task_status: Any) -> None:
                async with backend.lock(lock_name, ttl=5.0):
                    task_status.started()
                    holding.set()
                    await anyio.sleep_forever()

            await tg.start(holder)
            with anyio.move_on_after(0.2) as waiting:  # a waiter cancelled while it waits
                await backend.acquire(lock_name, ttl=5.0)
            assert waiting.cancelled_caught
            tg.cancel_scope.cancel()  # the holder cancelled inside its body
        async with backend.lock(lock_name, ttl=5.0, blocking=False) as after:
            assert await backend.validate(lock_name, after.token)
        assert backend.stats().held == 0


async def test_two_sqlite_backends_wake_each_other(
    spec_sqlite: BackendSpec, lock_name: str
) -> None:
    """Across backends (as across processes) a release wakes the other side's waiter
    through sqlite's wake-up socket (anyio.wait_readable), under trio as under asyncio."""
    counter = 0
    inside = 0

    async def worker(backend: asynclock.Backend) -> None:
        nonlocal counter, inside
        for _ in range(10):
            async with backend.lock(lock_name, ttl=5.0, timeout=20):
                inside += 1
                assert inside == 1, "two holders at once"
                value = counter
                await anyio.sleep(0.001)
                counter = value + 1
                inside -= 1

    with anyio.fail_after(40):
        async with spec_sqlite.connect() as one, spec_sqlite.connect() as two:
            holding, release = anyio.Event(), anyio.Event()
            tokens: list[int] = []

            async def holder() -> None:
                async with one.lock(lock_name, ttl=5.0) as lease:
                    tokens.append(lease.token)
                    holding.set()
                    await release.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await holding.wait()
                with pytest.raises(asynclock.LockHeld):
                    await two.acquire(lock_name, ttl=5.0, blocking=False)
                release.set()
                async with two.lock(lock_name, ttl=5.0, timeout=10) as second:
                    tokens.append(second.token)
            assert tokens[1] > tokens[0]
            async with anyio.create_task_group() as tg:
                for backend in (one, two, one, two):
                    tg.start_soon(worker, backend)
    assert counter == 40


# -- backends whose driver library runs only on asyncio ----------------------------------

ASYNCIO_ONLY = ["redis", "redlock", "postgres", "postgres_lease", "etcd", "zookeeper"]


@pytest.fixture(params=ASYNCIO_ONLY)
def asyncio_only_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


def check_message(exc: BaseException) -> None:
    text = str(exc)
    assert "needs asyncio" in text and "runs under trio" in text, text
    assert "anyio.run(main, backend='asyncio')" in text and "sqlite://" in text, text
    assert "no running event loop" not in text


async def test_asyncio_only_backends_refuse_trio_at_connect(
    asyncio_only_spec: BackendSpec,
) -> None:
    with pytest.raises(RuntimeError) as info:
        asyncio_only_spec.connect()
    check_message(info.value)


async def test_asyncio_only_backends_refuse_trio_at_open(
    asyncio_only_spec: BackendSpec,
) -> None:
    # connect() outside any event loop (as at import time) cannot tell; open can.
    backend = await anyio.to_thread.run_sync(asyncio_only_spec.connect)
    with anyio.fail_after(10), pytest.raises(RuntimeError) as info:
        async with backend:
            pytest.fail("opened under trio")
    check_message(info.value)


async def test_holder_extend_break_and_locked_function(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(30):
        await gaps.test_holder_and_locked(spec, backend, lock_name)
        await gaps.test_extend_shorter_moves_the_deadline_and_the_heartbeat(
            spec, backend, lock_name + ":short"
        )
        await gaps.test_concurrent_and_cancelled_extends(spec, backend, lock_name + ":cc")
        await gaps.test_extend_refused_loses_the_lease_loudly(spec, backend, lock_name + ":no")
        await gaps.test_break_lock_hands_the_name_to_a_waiter(backend, lock_name + ":break")
        await gaps.test_locked_function(backend, lock_name + ":fn")
