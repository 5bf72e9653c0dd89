"""Many blocks exiting at once (issue 45 item 3): one backend holds every name, a task and
an ``async with`` each, then every block exits at the same moment (as at shutdown); waiters
in a second backend wait for some of the names meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

import asynclock
import asynclock.testing


@dataclass
class MassRelease:
    #: Seconds from the moment every block was told to exit until the last one had.
    release_s: float = 0.0
    #: LeaseLost raised by the exits (a release that found its lease lost).
    lost: list[str] = field(default_factory=list)
    #: Seconds from the end of the mass release until each waiter held its name.
    waited_s: list[float] = field(default_factory=list)
    #: How much ``calls()`` grew during the mass release.
    calls: int = 0


async def hold_and_release_all(
    backend: asynclock.Backend,
    names: list[str],
    ttl: float,
    *,
    waiters: asynclock.Backend,
    waited_for: list[str],
    calls: Callable[[], int] = lambda: 0,
    in_flight: int | None = None,
) -> MassRelease:
    """Hold ``names`` in ``backend`` with ``ttl``, make ``waiters`` wait for ``waited_for``
    (each has been told busy once), then let every block exit at once. ``calls``: a count
    of server calls, read before and after the mass release. ``in_flight``: acquisitions
    at once (None: all of them)."""
    limiter = anyio.CapacityLimiter(in_flight or len(names))
    result = MassRelease()
    go, all_held, all_waiting = anyio.Event(), anyio.Event(), anyio.Event()
    held, waiting = [0], [0]
    released_at = [0.0]
    done = anyio.Event()

    async def hold(name: str) -> None:
        await limiter.acquire()
        acquiring = True
        try:
            async with backend.lock(name, ttl=ttl, timeout=30):
                limiter.release()
                acquiring = False
                held[0] += 1
                if held[0] == len(names):
                    all_held.set()
                await go.wait()
        except asynclock.LeaseLost as exc:
            result.lost.append(f"{name}: {exc.reason}")
        finally:
            if acquiring:
                limiter.release()

    async def wait_for(name: str) -> None:
        try:
            async with waiters.lock(name, ttl=30, blocking=False):
                raise AssertionError(f"{name} was free while held")
        except asynclock.LockHeld:
            pass
        waiting[0] += 1
        if waiting[0] == len(waited_for):
            all_waiting.set()
        async with waiters.lock(name, ttl=30, timeout=30):
            got = time.perf_counter()
            await done.wait()  # released_at is set once every block has exited
            result.waited_s.append(got - released_at[0])  # < 0: during the mass release

    with anyio.fail_after(60):
        async with anyio.create_task_group() as outer:
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(hold, name)
                await all_held.wait()
                for name in waited_for:
                    outer.start_soon(wait_for, name)
                await all_waiting.wait()
                # Every lease renewed since the waiters came (a renewal round ends).
                await asynclock.testing.next_renewal_round(backend)
                calls_before = calls()
                started = time.perf_counter()
                go.set()
            released_at[0] = time.perf_counter()
            result.release_s = released_at[0] - started
            result.calls = calls() - calls_before
            done.set()
    return result
