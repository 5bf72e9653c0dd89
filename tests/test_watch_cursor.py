"""A failed attempt's ``Busy.cursor`` reaches the driver's ``watch(name, cursor)``
(Driver.watch's contract), and moves the watch when it changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import anyio
import pytest

import asynclock
from asynclock._core.driver import Busy
from asynclock.backends.memory import MemoryDriver

pytestmark = pytest.mark.anyio


class CursorDriver(MemoryDriver):
    """The memory driver, its Busy answers marked with a cursor, its watch calls recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.watched: list[tuple[str, object]] = []
        self.watching = anyio.Event()

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        result = await super().acquire(name, owner, ttl, queue=queue, scope=scope)
        self.attempts += 1
        if isinstance(result, int):
            return result
        return dataclasses.replace(result, cursor=("revision", self.attempts))

    async def watch(self, name: str, cursor: object = None) -> bool:
        self.watched.append((name, cursor))
        self.watching.set()
        return False


async def _wait_behind_a_holder(backend: asynclock.Backend, watching: anyio.Event) -> None:
    """One waiter fails an attempt (so it watches), then gets the lock once it is free."""

    async def waiter() -> None:
        async with backend.lock("cursor", ttl=5.0):
            pass

    async with anyio.create_task_group() as tg:
        async with backend.lock("cursor", ttl=5.0):
            tg.start_soon(waiter)
            await watching.wait()  # the waiter failed an attempt and watches


async def test_the_failed_attempts_cursor_is_passed_to_watch() -> None:
    driver = CursorDriver()
    async with asynclock.Backend(driver) as backend:
        with anyio.fail_after(10):
            await _wait_behind_a_holder(backend, driver.watching)
    assert driver.watched == [("cursor", ("revision", 2))]  # the first failed attempt's


class MovingCursor(MemoryDriver):
    """Busy answers carry ``("pred", self.pred)``; watch and unwatch calls are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.pred = 1
        self.busy = 0
        self.watched: list[object] = []
        self.unwatched = 0
        self.changed = anyio.Event()

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        result = await super().acquire(name, owner, ttl, queue=queue, scope=scope)
        if isinstance(result, int):
            return result
        self.busy += 1
        self.changed.set()
        return dataclasses.replace(result, cursor=("pred", self.pred))

    async def watch(self, name: str, cursor: object = None) -> bool:
        self.watched.append(cursor)
        self.changed.set()
        return False

    async def unwatch(self, name: str) -> None:
        self.unwatched += 1

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self.changed = anyio.Event()
            await self.changed.wait()


async def test_a_new_cursor_moves_the_watch_and_an_unchanged_one_does_not() -> None:
    driver = MovingCursor()
    async with asynclock.Backend(driver) as backend:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async with backend.lock("cursor", ttl=5.0):

                    async def waiter() -> None:
                        async with backend.lock("cursor", ttl=5.0):
                            pass

                    tg.start_soon(waiter)
                    await driver.until(lambda: driver.watched == [("pred", 1)])
                    driver._wake("cursor")  # the same predecessor: no new watch
                    await driver.until(lambda: driver.busy == 2)
                    driver.pred = 2
                    driver._wake("cursor")  # a new one: watched from its cursor
                    await driver.until(lambda: driver.watched == [("pred", 1), ("pred", 2)])
    assert driver.busy == 3
    assert driver.unwatched == 1  # once per wait, however often the watch moved
