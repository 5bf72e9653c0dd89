"""Semaphore waiters are served first come, first served (issue 42 part 1: "a FIFO queue
that skips a dead waiter"), on every backend with semaphores: a later waiter, a
``blocking=False`` attempt or a waiter polling right after a release never overtakes an
earlier waiter; a waiter that gives up leaves the queue at once; a waiter that died (its
place never asked for again) is skipped once its place lapses.

Waiters are known to be queued from the store's own answer (an event set when a blocking
attempt was answered "full"), never from a sleep."""

from __future__ import annotations

import time

import anyio
import pytest

import asynclock
from asynclock._core.permit_store import Answer, Full, place_ttl
from tests.support.permits import queued
from tests.support.spec import BackendSpec, specs_split_by

pytestmark = pytest.mark.anyio

spec, _ = specs_split_by("semaphore")

WAIT = 30.0


async def test_waiters_are_granted_in_arrival_order(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """Limit 2, one permit held throughout: the other is handed down the queue one waiter
    at a time, in the order the waiters arrived, although after the release the waiters
    ask the server in the *reverse* order (the last to arrive asks first: each waiter's
    first attempt after the release is let through only after the next one's answer)."""
    n = 6
    order: list[int] = []
    released = anyio.Event()
    turns = [anyio.Event() for _ in range(n + 1)]  # turns[i]: waiter i may ask

    def gated(sem: asynclock.Semaphore, i: int) -> None:
        real, asked = sem._store.grant, False

        async def grant(owner: str, ttl: float, *, queue: bool = False) -> Answer:
            nonlocal asked
            if not released.is_set() or asked:
                return await real(owner, ttl, queue=queue)
            await turns[i + 1].wait()
            asked = True
            try:
                return await real(owner, ttl, queue=queue)
            finally:
                turns[i].set()

        sem._store.grant = grant  # type: ignore[method-assign]

    with anyio.fail_after(WAIT):
        async with (
            backend.semaphore(lock_name, 2).acquire(ttl=10),
            backend.semaphore(lock_name, 2).acquire(ttl=10) as first,
        ):

            async def waiter(i: int, sem: asynclock.Semaphore) -> None:
                async with sem.acquire(ttl=10):
                    order.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    sem = backend.semaphore(lock_name, 2)
                    in_queue = queued(sem)
                    gated(sem, i)
                    tg.start_soon(waiter, i, sem)
                    await in_queue.wait()
                assert order == []
                released.set()
                turns[n].set()
                assert await first.release() is True
    assert order == list(range(n))


async def test_a_blocking_false_attempt_never_overtakes_a_queued_waiter(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    got: list[str] = []
    with anyio.fail_after(WAIT):
        sem = backend.semaphore(lock_name, 1)
        in_queue = queued(sem)
        granted, tried = anyio.Event(), anyio.Event()

        async def waiter() -> None:
            async with sem.acquire(ttl=10):
                got.append("waiter")
                granted.set()
                # Held until the newcomer has tried. Without this, on a loaded machine the
                # waiter was granted, done and gone before the newcomer's attempt (seen on
                # ZooKeeper: got == ["waiter", "overtaker"]): no queue and a free permit,
                # which the newcomer rightly took.
                with anyio.move_on_after(WAIT):
                    await tried.wait()

        async with (
            backend.semaphore(lock_name, 1).acquire(ttl=10) as holder,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(waiter)
            await in_queue.wait()
            assert await holder.release() is True
            # The permit is free, but promised to the waiter that came first (which may
            # hold it already).
            try:
                with pytest.raises(asynclock.LockHeld):
                    async with backend.semaphore(lock_name, 1).acquire(ttl=10, blocking=False):
                        got.append("overtaker")
            finally:
                tried.set()
            await granted.wait()
    assert got == ["waiter"]


async def test_a_waiter_that_gives_up_leaves_the_queue_at_once(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(WAIT):
        sem = backend.semaphore(lock_name, 1)
        in_queue = queued(sem)

        async def waiter(scope: anyio.CancelScope) -> None:
            with scope:
                async with sem.acquire(ttl=10):
                    pytest.fail("granted while held")

        scope = anyio.CancelScope()
        async with backend.semaphore(lock_name, 1).acquire(ttl=10) as holder:
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter, scope)
                await in_queue.wait()
                scope.cancel()  # the task group waits for its clean-up (the withdrawal)
            assert await holder.release() is True
            async with backend.semaphore(lock_name, 1).acquire(ttl=10, blocking=False) as permit:
                assert permit.slot == 0


async def test_a_dead_waiters_place_lapses(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """A waiter that queued and then died (its process killed: nobody asks for its place
    again) holds the queue up only until its place lapses, never for ever."""
    ttl = 1.0
    with anyio.fail_after(WAIT):
        async with backend.semaphore(lock_name, 1).acquire(ttl=10) as holder:
            dead = backend.semaphore(lock_name, 1)._store
            assert isinstance(await dead.grant("a-waiter-that-died", ttl, queue=True), Full)
            lapses = time.monotonic() + place_ttl(ttl)
            assert await holder.release() is True
        with pytest.raises(asynclock.LockHeld):  # the dead waiter's place is still ahead
            async with backend.semaphore(lock_name, 1).acquire(ttl=10, blocking=False):
                pass
        async with backend.semaphore(lock_name, 1).acquire(ttl=10, timeout=10) as permit:
            late = time.monotonic() - lapses
    assert permit.slot == 0
    # Granted once the place lapsed: not before, and within the waiter's poll (ttl / 10,
    # at most 0.5 s) plus a loaded machine's margin after.
    assert -0.1 <= late <= 2.0, late


def test_a_place_lasts_half_the_ttl_between_one_and_five_seconds() -> None:
    assert [place_ttl(t) for t in (0.1, 1.0, 3.0, 10.0, 600.0)] == [1.0, 1.0, 1.5, 5.0, 5.0]
