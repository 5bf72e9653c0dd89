"""G1: at most one holder per name — 50 tasks in one process, 4 processes on one name."""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import asynclock
from asynclock._harness import Hold, check, overlaps
from tests.support.procs import start_worker
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


async def test_fifty_tasks_never_lose_an_update(backend: asynclock.Backend, lock_name: str) -> None:
    counter = 0
    inside = 0
    rounds = 4

    async def worker() -> None:
        nonlocal counter, inside
        for _ in range(rounds):
            async with backend.lock(lock_name, ttl=5.0):
                inside += 1
                assert inside == 1, "two holders at once"
                value = counter
                await anyio.lowlevel.checkpoint()
                counter = value + 1
                inside -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(worker)
    assert counter == 50 * rounds
    assert backend.stats().acquired == 50 * rounds


async def count_in_processes(
    spec: BackendSpec, name: str, tmp_path: Path, rounds: int, processes: int = 4
) -> tuple[list[Hold], int]:
    """``processes`` workers each add 1 to a counter file ``rounds`` times under the lock
    (read-modify-write). Returns their holds, for the history checker, and the count."""
    counter = anyio.Path(tmp_path / "counter")
    await counter.write_text("0")
    workers = [
        await start_worker(spec, mode="count", name=name, rounds=rounds, counter_file=str(counter))
        for _ in range(processes)
    ]
    holds: list[Hold] = []
    for w in workers:
        done = await w.expect("done")
        holds += [Hold.from_json(raw) for raw in done["holds"]]
        assert await w.wait() == 0
    return holds, int(await counter.read_text())


async def test_four_processes_never_lose_an_update(
    shared_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    rounds = 25
    holds, count = await count_in_processes(shared_spec, lock_name, tmp_path, rounds)
    assert count == 4 * rounds
    assert overlaps(holds) == []  # no two processes believed they held it at once


async def test_four_processes_get_tokens_in_hold_order(
    shared_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    """G2 under contention between processes: each hold's token is above the one before."""
    rounds = 25
    holds, count = await count_in_processes(shared_spec, lock_name, tmp_path, rounds)
    assert check(holds, increments=4 * rounds, final=count) == []


async def test_blocking_false_raises_lock_held(backend: asynclock.Backend, lock_name: str) -> None:
    # Held through acquire(), not a nested `async with` (this task would get AlreadyHeld).
    held = await backend.acquire(lock_name, ttl=5.0)
    with pytest.raises(asynclock.LockHeld) as info:
        async with backend.lock(lock_name, ttl=5.0, blocking=False):
            pytest.fail("acquired a held lock")
    assert type(info.value) is asynclock.LockHeld
    assert info.value.name == lock_name
    assert info.value.retry_after is None or 0 < info.value.retry_after <= 5.0
    assert await held.release()


async def test_timeout_raises_acquire_timeout(backend: asynclock.Backend, lock_name: str) -> None:
    held = await backend.acquire(lock_name, ttl=5.0)  # not a nested `async with` (AlreadyHeld)
    with pytest.raises(asynclock.AcquireTimeout) as info:
        async with backend.lock(lock_name, ttl=5.0, timeout=0.1):
            pytest.fail("acquired a held lock")
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(asynclock.AcquireTimeout):
        await backend.acquire(lock_name, ttl=5.0, timeout=0)
    assert await held.release()


async def test_waiter_gets_lock_after_release(backend: asynclock.Backend, lock_name: str) -> None:
    got: list[int] = []
    holding = anyio.Event()
    release = anyio.Event()

    async def holder() -> None:
        async with backend.lock(lock_name, ttl=5.0) as lease:
            got.append(lease.token)
            holding.set()
            await release.wait()

    async def waiter() -> None:
        await holding.wait()
        async with backend.lock(lock_name, ttl=5.0, timeout=10) as lease:
            got.append(lease.token)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        tg.start_soon(waiter)
        await holding.wait()
        release.set()
    assert got[1] > got[0]


async def test_different_names_do_not_block(backend: asynclock.Backend, lock_name: str) -> None:
    async with backend.lock(lock_name + ":a", ttl=5.0) as a:
        async with backend.lock(lock_name + ":b", ttl=5.0, blocking=False) as b:
            assert a.name != b.name
