"""asynclock.testing's helpers themselves: the manual clock, the renewer's next round and
driver faults (the suite uses them in place of private names)."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.backends.memory import MemoryDriver
from asynclock.testing import DriverFaults, ManualClock, memory_backend, next_renewal_round

pytestmark = pytest.mark.anyio


async def test_manual_clock_wakes_sleepers_it_passes() -> None:
    clock = ManualClock(5.0)
    woke: list[float] = []

    async def sleeper(deadline: float) -> None:
        await clock.sleep_until(deadline)
        woke.append(clock.now())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sleeper, 6.0)
            tg.start_soon(sleeper, 8.0)
            await anyio.wait_all_tasks_blocked()
            clock.advance(1.5)
            await anyio.wait_all_tasks_blocked()
            assert woke == [6.5]
            clock.advance(2.0)
    assert woke == [6.5, 8.5]
    await clock.sleep_until(1.0)  # already past: returns at once


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_manual_clock_rejects_going_back_or_nowhere(bad: float) -> None:
    with pytest.raises(ValueError, match="seconds must be a finite number >= 0"):
        ManualClock().advance(bad)
    with pytest.raises(ValueError, match="start must be a finite number"):
        ManualClock(math.nan)


async def test_manual_clock_drives_a_backend_and_next_round_waits_for_it() -> None:
    clock = ManualClock(100.0)
    async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
        lease = await backend.acquire("x", ttl=3.0)
        before = lease.deadline
        clock.advance(1.0)
        with anyio.fail_after(10):
            await next_renewal_round(backend)
        assert lease.deadline == pytest.approx(before + 1.0)
        assert backend.stats().renewals == 1


async def test_faults_fail_hang_hook_and_restore() -> None:
    async with memory_backend() as backend:
        driver = backend.driver
        seen: list[str] = []

        async def hook(call: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return await call(name, *args, **kwargs)

        with DriverFaults(backend) as faults:
            faults.fail("acquire", ConnectionError("down"), calls=1)
            faults.around("acquire", hook)  # outermost: sees the failing call too
            with pytest.raises(asynclock.BackendUnavailable):
                await backend.acquire("a", ttl=5.0)
            lease = await backend.acquire("b", ttl=5.0)  # the second call goes through
            assert seen == ["a", "b"]
            hung = faults.hang("validate")
            with anyio.move_on_after(0.2):
                await backend.validate("b", lease.token)
            assert hung.is_set()
        assert "acquire" not in vars(driver) and "validate" not in vars(driver)
        assert await backend.validate("b", lease.token)
        assert await lease.release()


async def test_faults_check_their_arguments() -> None:
    async with memory_backend() as backend:
        faults = DriverFaults(backend)
        with pytest.raises(ValueError, match=r"method='extnd' is not a driver call; choose from"):
            faults.fail("extnd", ConnectionError())
        with pytest.raises(ValueError, match="calls must be >= 1"):
            faults.hang("extend", calls=0)
        with pytest.raises(TypeError, match="calls must be an int or None"):
            faults.hang("extend", calls=1.5)  # type: ignore[arg-type]
