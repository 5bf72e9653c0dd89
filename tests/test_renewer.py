"""The renewer with many holds (issue 45): each lease at its own cadence, rounds cut into
chunks most urgent first, a renewer falling behind said before any lease is lost, and a
storm of unconfirmed releases logged as one summary (memory backend, a ManualClock where
time matters; the Redis and claims tests run the same against real servers)."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.backends import Refused
from asynclock.backends.memory import MemoryDriver
from asynclock.testing import DriverFaults, ManualClock, next_renewal_round

pytestmark = pytest.mark.anyio


class Behind(asynclock.Observer):
    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def renewal_behind(self, leases: int, left: float) -> None:
        self.calls.append((leases, left))


async def test_a_renewer_falling_behind_warns_before_any_lease_is_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The loop frozen past the renewals' due time but short of the deadlines (a clock
    jump stands in for it): the round that finally runs says so, counts it, tells the
    observers, and nothing is lost."""
    clock = ManualClock(1000.0)
    behind = Behind()
    async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
        backend.add_observer(behind)
        leases = [await backend.acquire(f"late:{i}", ttl=9.0) for i in range(3)]
        with caplog.at_level(logging.WARNING, logger="asynclock"):
            # Due at +3; deadline at +8.905; the budget between them is 5.9 s. At +6.2
            # less than half of it is left.
            clock.advance(6.2)
            with anyio.fail_after(5):
                await next_renewal_round(backend)
        stats = backend.stats()
        assert stats.renewals_late == 3 and stats.losses == 0
        assert not any(lease.lost for lease in leases)
        assert behind.calls and behind.calls[0][0] == 3 and 0 < behind.calls[0][1] < 3
        warnings = [r.getMessage() for r in caplog.records if "renewer behind" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "3 leases" in warnings[0] and "woke" in warnings[0]
        # Renewed in that round: on time from here on, and no new warning.
        caplog.clear()
        clock.advance(3.0)
        with anyio.fail_after(5):
            await next_renewal_round(backend)
        assert backend.stats().renewals_late == 3
        for lease in leases:
            await lease.release()


async def test_each_lease_is_renewed_at_its_own_cadence() -> None:
    clock = ManualClock(1000.0)
    async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
        renewed: dict[str, int] = {}

        async def count(call: Any, refs: Any) -> Any:
            for ref in refs:
                renewed[ref.name] = renewed.get(ref.name, 0) + 1
            return await call(refs)

        with DriverFaults(backend) as faults:
            faults.around("extend", count)
            short = await backend.acquire("short", ttl=3.0)
            long = await backend.acquire("long", ttl=60.0)
            for _ in range(6):  # 6 s, one of the short lease's intervals at a time
                clock.advance(1.0)
                with anyio.fail_after(5):
                    await next_renewal_round(backend)
        assert renewed["short"] == 6
        assert renewed.get("long", 0) == 0  # due only after 20 s
        assert not short.lost and not long.lost
        await short.release()
        await long.release()


async def test_a_large_round_goes_out_in_chunks_most_urgent_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = ManualClock(1000.0)
    driver = MemoryDriver()
    monkeypatch.setattr(driver, "renew_chunk", 10)
    async with asynclock.Backend(driver, clock=clock) as backend:
        calls: list[list[str]] = []

        async def record(call: Any, refs: Any) -> Any:
            calls.append([ref.name for ref in refs])
            return await call(refs)

        # 35 leases acquired 0.01 s apart: all due in one round, deadlines in that order.
        leases = []
        for i in range(35):
            leases.append(await backend.acquire(f"chunk:{i:02d}", ttl=9.0))
            clock.advance(0.01)
        with DriverFaults(backend) as faults:
            faults.around("extend", record)
            clock.advance(3.0)
            with anyio.fail_after(5):
                while sum(len(c) for c in calls) < 35:
                    await next_renewal_round(backend)
        assert sorted(len(c) for c in calls) == [5, 10, 10, 10]
        assert sorted(name for c in calls for name in c) == [lease.name for lease in leases]
        first = min(calls, key=lambda c: c[0])  # the call with the earliest deadlines
        assert first == [f"chunk:{i:02d}" for i in range(10)]
        assert backend.stats().losses == 0
        for lease in leases:
            await lease.release()


async def test_a_storm_of_unconfirmed_releases_logs_one_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """50 blocks exit at once while every release fails: one WARNING for the first and a
    summary for the rest, not 50 lines; each lease is left to expire at the server."""
    async with asynclock.connect("memory://") as backend:
        go, all_held = anyio.Event(), anyio.Event()
        held = 0
        with DriverFaults(backend) as faults, caplog.at_level(logging.WARNING, "asynclock"):
            faults.fail("release", ConnectionError("the server went away (test)"))

            async def hold(i: int) -> None:
                nonlocal held
                async with backend.lock(f"storm:{i}", ttl=30.0):
                    held += 1
                    if held == 50:
                        all_held.set()
                    await go.wait()

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for i in range(50):
                        tg.start_soon(hold, i)
                    await all_held.wait()
                    go.set()
            backend._session.flush_release_failures()
        lines = [r.getMessage() for r in caplog.records if "release" in r.getMessage()]
        assert len(lines) == 2, lines
        assert "49 more releases were not confirmed" in lines[1]


class RaisesOnLoss(asynclock.Observer):
    def __init__(self) -> None:
        self.told: list[str] = []

    def lost(self, lease: asynclock.Lease, reason: str) -> None:
        self.told.append(lease.name)
        raise RuntimeError("a broken observer (test)")


async def test_a_raising_observer_neither_keeps_a_holder_running_nor_stops_other_losses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Observers must not raise, but one that does is the user's bug, not a reason to
    break G4: both leases refused in one renewal round are lost, both holders' bodies are
    cancelled (LeaseLost), the observer is told of each, and its error is logged."""
    clock = ManualClock(1000.0)
    observer = RaisesOnLoss()
    ended: dict[str, str] = {}
    async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
        backend.add_observer(observer)
        holding = 0
        both = anyio.Event()

        async def hold(name: str) -> None:
            nonlocal holding
            try:
                async with backend.lock(name, ttl=3.0):
                    holding += 1
                    if holding == 2:
                        both.set()
                    await anyio.sleep_forever()
            except asynclock.LeaseLost:
                ended[name] = "LeaseLost"

        async def refuse(call: Any, refs: Any) -> Any:
            return [Refused("gone at the server (test)") for _ in refs]

        with caplog.at_level(logging.ERROR, logger="asynclock"), anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold, "a")
                tg.start_soon(hold, "b")
                await both.wait()
                with DriverFaults(backend) as faults:
                    faults.around("extend", refuse)
                    clock.advance(1.5)  # past the first renewal (ttl / 3), short of the deadline
                    await next_renewal_round(backend)
        assert ended == {"a": "LeaseLost", "b": "LeaseLost"}
        assert sorted(observer.told) == ["a", "b"]
        assert backend.stats().losses == 2
    errors = [r for r in caplog.records if "a broken observer (test)" in str(r.exc_info)]
    assert len(errors) == 2, [r.getMessage() for r in caplog.records]
