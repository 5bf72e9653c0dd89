"""G6: cancel a task at every await point of acquire, wait, extend and release.

Every driver call made by the task under test is wrapped with a hook before and after the
server call. A first run counts the points; then, for each point k, the task's cancel
scope is cancelled exactly there ("after" = the server already did the work but the
answer never reached the caller, the dangerous case). Afterwards the name must be free
*at once* (nothing leaked, not even for a ttl) and the backend must still work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asynclock
import asynclock.testing
from asynclock.backends import Busy

pytestmark = pytest.mark.anyio

HOOKED = ("acquire", "release", "watch", "unwatch", "abandon", "extend")


class Injector:
    def __init__(self, backend: asynclock.Backend) -> None:
        self.points: list[str] = []
        self.cancel_at: int | None = None
        self.scope: anyio.CancelScope | None = None
        self.task_id: int | None = None
        self.busy_seen = anyio.Event()
        self.fired: str | None = None
        faults = asynclock.testing.DriverFaults(backend)
        for method in HOOKED:
            faults.around(method, self._wrap(method))

    def _wrap(self, method: str) -> Callable[..., Awaitable[Any]]:
        async def wrapped(call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
            await self._point(f"{method}:before")
            result = await call(*args, **kwargs)
            if method == "acquire" and isinstance(result, Busy):
                self.busy_seen.set()
            await self._point(f"{method}:after")
            return result

        return wrapped

    async def _point(self, label: str) -> None:
        if anyio.get_current_task().id != self.task_id:
            return
        index = len(self.points)
        self.points.append(label)
        if index == self.cancel_at and self.scope is not None:
            self.fired = label
            self.scope.cancel()
            await anyio.lowlevel.checkpoint()


async def run_scenario(backend: asynclock.Backend, injector: Injector, name: str) -> None:
    """Task B waits for a lock that task A holds, gets it, holds it over a renewal, exits."""
    a_holds = anyio.Event()

    async def holder_a() -> None:
        async with backend.lock(name, ttl=5.0):
            a_holds.set()
            await injector.busy_seen.wait()

    async def task_b() -> None:
        await a_holds.wait()
        injector.task_id = anyio.get_current_task().id
        try:
            await guarded_b()
        finally:
            injector.busy_seen.set()  # B is gone (cancelled early): let A finish

    async def guarded_b() -> None:
        with anyio.CancelScope() as scope:
            injector.scope = scope
            async with backend.lock(name, ttl=0.3, timeout=10) as lease:
                await asynclock.testing.next_renewal_round(backend)
                assert not lease.lost

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder_a)
        tg.start_soon(task_b)
        with anyio.fail_after(10):
            await injector.busy_seen.wait()


async def test_cancel_at_every_await_point(spec: Any, lock_name: str) -> None:
    async with spec.connect() as backend:
        injector = Injector(backend)
        await run_scenario(backend, injector, lock_name + ":count")
        labels = list(injector.points)
    for expected in ("acquire:after", "watch:before", "release:after"):
        assert expected in labels, labels
    for k, label in enumerate(labels):
        name = f"{lock_name}:{k}"
        async with spec.connect() as backend:
            injector = Injector(backend)
            injector.cancel_at = k
            await run_scenario(backend, injector, name)
            assert injector.fired == label, (k, injector.points)
            # Nothing leaked: the name is free right now, and the backend still works.
            async with backend.lock(name, ttl=5.0, blocking=False) as after:
                assert await backend.validate(name, after.token)
            assert backend.stats().held == 0


async def test_hung_extend_is_bounded_and_retried(
    backend: asynclock.Backend, lock_name: str
) -> None:
    """An extend that never answers is abandoned by the core and retried; no loss."""
    hung = asynclock.testing.DriverFaults(backend).hang("extend", calls=1)
    async with backend.lock(lock_name, ttl=0.6) as lease:
        await hung.wait()
        while backend.stats().renewals < 1:
            await asynclock.testing.next_renewal_round(backend)
        assert not lease.lost
    stats = backend.stats()
    assert stats.renewal_errors >= 1 and stats.losses == 0


async def test_renewals_that_keep_failing_lose_the_lease_at_the_deadline(
    backend: asynclock.Backend, lock_name: str
) -> None:
    asynclock.testing.DriverFaults(backend).fail("extend", ConnectionError("simulated outage"))
    with pytest.raises(asynclock.LeaseLost) as info:
        async with backend.lock(lock_name, ttl=0.3):
            await anyio.sleep_forever()
    assert info.value.reason == "local deadline passed"
    assert backend.stats().renewal_errors >= 2  # retried with backoff before giving up


async def test_cancelled_before_lock_never_enters_the_body(
    backend: asynclock.Backend, lock_name: str
) -> None:
    """A task whose scope is already cancelled never runs the body, and leaks nothing.

    Network drivers set ``remote`` and the core then relies on the attempt's own
    suspension to deliver the cancellation: this fails if a driver claims that and grants
    without suspending.
    """
    entered = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with backend.lock(lock_name, ttl=5.0):
            entered = True
    assert scope.cancelled_caught and not entered
    async with backend.lock(lock_name, ttl=5.0, blocking=False) as after:
        assert await backend.validate(lock_name, after.token)
    assert backend.stats().held == 0
