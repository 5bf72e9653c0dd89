"""``asynclock.current_lease()`` and ``use_lease()``: the innermost lease of this context."""

from __future__ import annotations

import threading

import anyio
import pytest

import asynclock
from asynclock.testing import memory_backend

pytestmark = pytest.mark.anyio


def test_outside_any_hold_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="no asynclock lease is held"):
        asynclock.current_lease()


async def test_innermost_hold_wins_and_unwinds() -> None:
    async with memory_backend() as backend:
        async with backend.lock("outer", ttl=5) as outer:
            assert asynclock.current_lease() is outer
            async with backend.lock("inner", ttl=5) as inner:
                assert asynclock.current_lease() is inner
            assert asynclock.current_lease() is outer
    with pytest.raises(LookupError):
        asynclock.current_lease()


async def test_child_tasks_see_a_copy_and_siblings_do_not_mix() -> None:
    seen: dict[str, asynclock.Lease] = {}

    async with memory_backend() as backend:

        async def worker(name: str, started: anyio.Event, go: anyio.Event) -> None:
            async with backend.lock(name, ttl=5):
                started.set()
                await go.wait()  # both hold at once here
                seen[name] = asynclock.current_lease()

        async with anyio.create_task_group() as tg:
            go = anyio.Event()
            starts = [anyio.Event(), anyio.Event()]
            tg.start_soon(worker, "a", starts[0], go)
            tg.start_soon(worker, "b", starts[1], go)
            for event in starts:
                await event.wait()
            with pytest.raises(LookupError):
                asynclock.current_lease()  # the parent holds nothing
            go.set()
    assert seen["a"].name == "a" and seen["b"].name == "b"


async def test_use_lease_in_another_thread() -> None:
    async with memory_backend() as backend, backend.lock("job", ttl=5) as lease:
        found: list[object] = []

        def body() -> None:
            with pytest.raises(LookupError):
                asynclock.current_lease()  # a new thread starts with an empty context
            with asynclock.use_lease(lease) as same:
                assert same is lease
                found.append(asynclock.current_lease())
            with pytest.raises(LookupError):
                asynclock.current_lease()

        thread = threading.Thread(target=body)
        thread.start()
        await anyio.to_thread.run_sync(thread.join, 5)
        assert found == [lease]


def test_use_lease_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match="takes an asynclock Lease, not int"):
        with asynclock.use_lease(42):  # type: ignore[arg-type]
            pass
