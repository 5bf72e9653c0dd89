"""Under uvloop (issue 23): memory://, sqlite:// and redis:// pass the conformance basics
(lock, contention between tasks, cancellation) and the loss contract (a frozen holder, a
blocked loop, a refused renewal: LeaseLost, the body cancelled, late writes fenced).

uvloop is the event loop most FastAPI (uvicorn) and many worker deployments run. The
conformance tests are reused as they are (called from here, on a uvloop loop), as
tests/test_trio.py does for trio, so the basics mean the same thing on every loop. A
subset only: the whole suite on a second loop would add minutes for little."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
import uvloop

import asynclock
from tests.conformance import test_cancellation as cancellation
from tests.conformance import test_exclusion as exclusion
from tests.conformance import test_loss as loss
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


@pytest.fixture(params=["memory", "sqlite", "redis"])
def spec(request: pytest.FixtureRequest) -> BackendSpec:
    """The fast backends and Redis (overrides the suite's every-backend ``spec``)."""
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.fixture(autouse=True)
def _under_uvloop(anyio_backend: tuple[str, dict[str, bool]]) -> None:
    assert anyio_backend[1] == {"use_uvloop": True}


async def test_really_under_uvloop() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


Step = Callable[[asynclock.Backend, str], Awaitable[None]]


async def each_on_a_fresh_backend(spec: BackendSpec, lock_name: str, steps: list[Step]) -> None:
    """The conformance tests count the backend's stats from zero: one backend each."""
    with anyio.fail_after(30):
        for i, step in enumerate(steps):
            async with spec.connect() as backend:
                await step(backend, f"{lock_name}:{i}")


async def test_lock_tokens_and_contention(spec: BackendSpec, lock_name: str) -> None:
    async def tokens(backend: asynclock.Backend, name: str) -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with backend.lock(name, ttl=5.0) as first:
            assert await backend.validate(name, first.token)
        async with backend.lock(name, ttl=5.0) as again:
            assert again.token > first.token

    await each_on_a_fresh_backend(
        spec,
        lock_name,
        [
            tokens,
            loss.test_released_lease_frees_the_name,
            exclusion.test_fifty_tasks_never_lose_an_update,
            exclusion.test_waiter_gets_lock_after_release,
            exclusion.test_blocking_false_raises_lock_held,
            exclusion.test_timeout_raises_acquire_timeout,
        ],
    )


async def test_loss_contract(spec: BackendSpec, lock_name: str) -> None:
    async def refused(backend: asynclock.Backend, name: str) -> None:
        await loss.test_refused_renewal_cancels_within_one_heartbeat(spec, backend, name)

    await each_on_a_fresh_backend(
        spec,
        lock_name,
        [
            loss.test_blocked_event_loop_past_ttl_cancels_holder,
            refused,
            loss.test_work_in_child_tasks_is_cancelled_on_loss,
            loss.test_lost_signal_is_awaitable,
            loss.test_max_hold_bounds_a_hung_holder,
            loss.test_deadline_passed_without_a_later_await_still_raises,
            loss.test_body_finishing_after_loss_still_raises,
            loss.test_body_exception_wins_over_loss,
        ],
    )


async def test_cancel_at_every_await_point(spec: BackendSpec, lock_name: str) -> None:
    with anyio.fail_after(50):
        await cancellation.test_cancel_at_every_await_point(spec, lock_name)


@pytest.mark.parametrize("backend_id", ["sqlite", "redis"])
async def test_sigstop_holder_on_uvloop_is_cancelled_and_fenced(
    request: pytest.FixtureRequest, backend_id: str, lock_name: str, tmp_path: Path
) -> None:
    """tests/conformance/test_loss.py's frozen holder, the holder process on uvloop."""
    shared_spec: BackendSpec = request.getfixturevalue(f"spec_{backend_id}")
    await loss.test_gc_pause_sigstop_holder_is_cancelled_and_fenced(
        shared_spec, lock_name, tmp_path, loop="uvloop"
    )
