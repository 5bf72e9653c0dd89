"""Misuse is a clear error at once, never a hang or a silently unrenewed lease (issue 8):
closing a backend under its waiters, a nested hold of the same name, a backend used from
another event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing
from asynclock._core.driver import Busy
from asynclock.backends.memory import MemoryDriver
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


async def assert_free(spec: BackendSpec, closed: asynclock.Backend, name: str) -> None:
    """``name`` is not held at the server (asked through a fresh backend)."""
    if isinstance(closed.driver, MemoryDriver):  # its state lives in the closed driver
        assert name not in closed.driver.leases
        return
    async with spec.connect() as fresh:
        with anyio.fail_after(10):
            lease = await fresh.acquire(name, ttl=5.0, blocking=False)
        assert await lease.release()


def hook_acquire(backend: asynclock.Backend, after: Callable[[object], Awaitable[None]]) -> None:
    """Run ``after(result)`` once the server has answered each acquire attempt."""
    real = backend.driver.acquire

    async def acquire(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        await after(result)
        return result

    setattr(backend.driver, "acquire", acquire)  # noqa: B010


# -- item 4: closing a backend under its waiters ----------------------------------------


async def test_closing_the_backend_fails_its_waiters(spec: BackendSpec, lock_name: str) -> None:
    backend = spec.connect()
    busy = anyio.Event()

    async def after(result: object) -> None:
        if isinstance(result, Busy):
            busy.set()

    hook_acquire(backend, after)
    outcome: list[BaseException | asynclock.Lease] = []

    async def waiter() -> None:
        try:
            outcome.append(await backend.acquire(lock_name, ttl=5.0))
        except Exception as exc:
            outcome.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg, backend:
            held = await backend.acquire(lock_name, ttl=5.0)
            tg.start_soon(waiter)
            await busy.wait()
            # leaving `async with backend` closes it under the waiter
    [result] = outcome
    assert isinstance(result, asynclock.BackendUnavailable), result
    assert "backend closed while waiting" in str(result)
    assert held.lost.reason == "backend closed"
    assert backend.held() == []
    await assert_free(spec, backend, lock_name)


async def test_a_lease_granted_while_closing_is_released(spec: BackendSpec, lock_name: str) -> None:
    backend = spec.connect()
    granted, go = anyio.Event(), anyio.Event()

    async def after(result: object) -> None:
        if isinstance(result, int):  # the server granted it; hold the answer until close
            granted.set()
            await go.wait()

    hook_acquire(backend, after)
    outcome: list[BaseException | asynclock.Lease] = []

    async def acquirer() -> None:
        try:
            outcome.append(await backend.acquire(lock_name, ttl=5.0))
        except Exception as exc:
            outcome.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg, backend:
            tg.start_soon(acquirer)
            await granted.wait()
            go.set()  # the acquirer goes on once close has begun (before close's first await)
    [result] = outcome
    assert isinstance(result, asynclock.BackendUnavailable), result
    assert "backend closed while acquiring" in str(result)
    await assert_free(spec, backend, lock_name)


# -- item 6: a nested hold of a name this task holds -------------------------------------


async def test_nested_hold_of_the_same_name_raises_at_once(
    backend: asynclock.Backend, lock_name: str
) -> None:
    async with backend.lock(lock_name, ttl=5.0) as outer:
        with anyio.fail_after(5):
            with pytest.raises(asynclock.AlreadyHeld, match="already held by this task") as info:
                async with backend.lock(lock_name, ttl=5.0):
                    pass  # pragma: no cover
            with pytest.raises(asynclock.LockHeld, match=f"token {outer.token}"):
                async with backend.lock(lock_name, ttl=5.0, blocking=False):
                    pass  # pragma: no cover
        assert info.value.token == outer.token
        assert info.value.name == lock_name
        async with backend.lock(lock_name + ":other", ttl=5.0):  # other names nest fine
            outer.check()
        outer.check()
    async with backend.lock(lock_name, ttl=5.0):  # and after the outer hold, it is free
        pass


@asynccontextmanager
async def outer_hold(backend: asynclock.Backend, kind: str, name: str) -> AsyncIterator[int]:
    """Hold ``name`` in this task the way ``kind`` says; yield the hold's token."""
    if kind == "lock":
        async with backend.lock(name, ttl=5.0) as lease:
            yield lease.token
    elif kind == "leadership":
        async with backend.leadership(name, ttl=5.0, identity="outer") as term:
            yield term.token
    else:  # a term of an `async for` loop, guarded by `async with term:` as the docs say
        async for term in backend.leadership(name, ttl=5.0, identity="outer"):
            async with term:
                yield term.token
            break


async def _enter(manager: AbstractAsyncContextManager[object]) -> None:
    async with manager:
        pass  # pragma: no cover


async def _campaign(backend: asynclock.Backend, name: str) -> None:
    async for _ in backend.leadership(name, ttl=5.0, identity="inner"):
        pass  # pragma: no cover


#: Every way one task can ask for a name again, by what it calls.
NESTED: dict[str, Callable[[asynclock.Backend, str], Awaitable[object]]] = {
    "lock": lambda b, n: _enter(b.lock(n, ttl=5.0)),
    "lock(timeout=30)": lambda b, n: _enter(b.lock(n, ttl=5.0, timeout=30)),
    "lock(blocking=False)": lambda b, n: _enter(b.lock(n, ttl=5.0, blocking=False)),
    "acquire": lambda b, n: b.acquire(n, ttl=5.0),
    "acquire(timeout=30)": lambda b, n: b.acquire(n, ttl=5.0, timeout=30),
    "acquire(blocking=False)": lambda b, n: b.acquire(n, ttl=5.0, blocking=False),
    "async with leadership": lambda b, n: _enter(b.leadership(n, ttl=5.0)),
    "async for leadership": _campaign,
}


@pytest.mark.parametrize("outer", ["lock", "leadership", "leadership loop"])
async def test_every_nested_hold_of_the_same_name_raises_at_once(
    backend: asynclock.Backend, lock_name: str, outer: str
) -> None:
    """Issue 21 item 5: a leadership term inside a lock, a lock or a term inside a term,
    an acquire() inside either: each waited for itself (forever, or until its timeout)."""
    kind = "lock" if outer == "lock" else "leadership"
    named = "outer `async with backend.lock(" if kind == "lock" else "a leadership term"
    async with outer_hold(backend, outer, lock_name) as token:
        for what, ask in NESTED.items():
            with anyio.fail_after(5), pytest.raises(asynclock.AlreadyHeld) as info:
                await ask(backend, lock_name)
            message = str(info.value)
            assert "already held by this task" in message, what
            assert named in message and f"token {token}" in message, (what, message)
            assert (info.value.name, info.value.token, info.value.outer) == (
                lock_name,
                token,
                kind,
            ), what
        [held] = backend.held()  # nothing else was granted or left behind
        assert held.token == token and not held.lost
        assert await backend.validate(lock_name, token)
    with anyio.fail_after(10):
        async with backend.lock(lock_name, ttl=5.0, blocking=False) as after:
            assert after.token > token  # and once the outer hold ends, the name is free


async def test_a_child_task_is_another_holder(backend: asynclock.Backend, lock_name: str) -> None:
    """A child task starts with a copy of its parent's holds: it waits like any other
    owner while the parent holds, and is not refused once the parent has released."""
    results: list[str | int] = []
    go = anyio.Event()

    async def child_while_held() -> None:
        with pytest.raises(asynclock.AcquireTimeout):
            async with backend.lock(lock_name, ttl=5.0, timeout=0.2):
                pass  # pragma: no cover
        results.append("waited")

    async def child_after_release() -> None:
        await go.wait()
        async with backend.lock(lock_name, ttl=5.0, timeout=20) as lease:
            results.append(lease.token)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async with backend.lock(lock_name, ttl=5.0) as outer:
                tg.start_soon(child_after_release)
                async with anyio.create_task_group() as inner:
                    inner.start_soon(child_while_held)
            go.set()
    assert results[0] == "waited"
    assert isinstance(results[1], int) and results[1] > outer.token


async def test_an_acquired_lease_is_not_a_task_hold(
    backend: asynclock.Backend, lock_name: str
) -> None:
    """``acquire()`` leases may be handed to other tasks, so they never refuse: a second
    acquisition of the name waits like any other owner."""
    lease = await backend.acquire(lock_name, ttl=5.0)
    with anyio.fail_after(10), pytest.raises(asynclock.AcquireTimeout):
        async with backend.lock(lock_name, ttl=5.0, timeout=0.2):
            pass  # pragma: no cover
    assert await lease.release()


# -- item 7: one backend, one event loop ------------------------------------------------


async def test_use_from_another_event_loop_raises_at_once(
    backend: asynclock.Backend, lock_name: str
) -> None:
    lease = await backend.acquire(lock_name, ttl=5.0)

    async def uses() -> list[str]:
        errors: list[str] = []

        async def hold() -> None:
            async with backend.lock(lock_name + ":2", ttl=5.0):
                pass  # pragma: no cover

        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: backend.acquire(lock_name + ":2", ttl=5.0),
            hold,
            lambda: backend.validate(lock_name, lease.token),
            lambda: backend.holder(lock_name),
            lambda: backend.break_lock(lock_name),
            lambda: lease.extend(5.0),
            lease.release,
        ]
        for call in calls:
            try:
                with anyio.fail_after(5):
                    await call()
            except RuntimeError as exc:
                errors.append(str(exc))
        return errors

    def in_another_thread() -> list[str]:
        return asyncio.run(uses())

    with anyio.fail_after(30):
        errors = await anyio.to_thread.run_sync(in_another_thread)
    assert len(errors) == 7, errors
    for error in errors:
        assert "belongs to the event loop it was opened in" in error
        assert "MainThread" in error  # the loop that opened it
    assert backend.held() == [lease]
    assert not lease.lost
    assert await backend.validate(lock_name, lease.token)
    assert await lease.release()


# -- item 11: a lease nobody references any more ------------------------------------------


async def test_a_dropped_lease_is_released_with_a_warning(
    backend: asynclock.Backend, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    kept = await backend.acquire(lock_name + ":kept", ttl=3.0)
    lease = await backend.acquire(lock_name, ttl=3.0)
    token = lease.token
    del lease
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="asynclock"), anyio.fail_after(20):
        await asynclock.testing.next_renewal_round(backend)  # the first after the drop
        assert backend.held() == [kept]
        # Released, not left to expire (that would take the whole ttl, 3 s).
        assert not await backend.validate(lock_name, token)
        again = await backend.acquire(lock_name, ttl=3.0, blocking=False)
    assert [r.getMessage() for r in caplog.records if "garbage-collected" in r.getMessage()] == [
        f"lease on {lock_name!r} (token {token}) was garbage-collected without release(): "
        "releasing it; call `await lease.release()`, or hold it with `async with "
        "backend.lock(...)`"
    ]
    assert await backend.validate(lock_name + ":kept", kept.token)  # still renewed
    assert not kept.lost
    assert await again.release()
    assert await kept.release()


async def test_dropped_leases_are_released_when_the_backend_closes(
    spec: BackendSpec, lock_name: str
) -> None:
    async with spec.connect() as backend:
        await backend.acquire(lock_name, ttl=30.0)  # dropped at once: never referenced
        gc.collect()
    await assert_free(spec, backend, lock_name)
