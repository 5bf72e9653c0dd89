"""Cross-process wake-ups of semaphore and read-write lock waiters (issue 42: a waiter
learns of a release from the server, not at its next poll).

Each test holds on one backend and waits on another (each its own connections and
subscriptions, so the wake-up can only come from the server's notification). The waiter
first waits until its polling backoff has reached its cap (0.5 s: ttl/10 >= 0.5), then the
hold is released right after one of its busy attempts: its next poll is ~0.5 s away, so a
grant within half of that after the release was woken by the release itself (a bound on
the mechanism, not a speed check: 100 ms failed under CI load at 102 ms)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

import asynclock
from asynclock._core.permit_store import MAX_POLL
from tests.support.spec import BackendSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: The backends whose store notifies its waiters (Redis and its routed deployments,
#: PostgreSQL in both modes).
NOTIFYING = ["redis", "redis_sentinel", "redis_cluster", "postgres", "postgres_lease"]
#: The read-write cases on one of each store (Sentinel and Cluster route to redis's store,
#: and both PostgreSQL modes share their statements; the semaphore case runs on all five).
RW_NOTIFYING = ["redis", "postgres_lease"]
TTL = 10.0  # ttl/10 >= MAX_POLL: the backoff's cap is MAX_POLL
#: A grant this soon after the release was woken by it (polling would take ~MAX_POLL).
WOKEN_WITHIN = MAX_POLL / 2


def attempts(backend: asynclock.Backend) -> int:
    return int(backend._acq.stats.busy_attempts)


async def next_attempt(backend: asynclock.Backend, after: int) -> int:
    """Wait (bounded) until ``backend`` has made a busy attempt beyond ``after``."""
    with anyio.fail_after(5):
        while attempts(backend) <= after:  # noqa: ASYNC110 (a counter: no event to wait on)
            await anyio.sleep(0.001)
    return attempts(backend)


async def release_after_capped_backoff(
    waiter: asynclock.Backend, release: Callable[[], Awaitable[object]]
) -> float:
    """Once ``waiter``'s backoff is at its cap (8 busy attempts: 10 ms doubling to 0.5 s),
    call ``release`` right after its next busy attempt; the time of the release."""
    await next_attempt(waiter, 7)
    await next_attempt(waiter, attempts(waiter))
    t_release = time.monotonic()
    await release()
    return t_release


@asynccontextmanager
async def two(spec: BackendSpec) -> AsyncIterator[tuple[asynclock.Backend, asynclock.Backend]]:
    async with spec.connect() as holder, spec.connect() as waiter:
        yield holder, waiter


@pytest.mark.parametrize("spec", NOTIFYING, indirect=True)
async def test_semaphore_waiter_woken_by_release_elsewhere(
    spec: BackendSpec, lock_name: str
) -> None:
    assert MAX_POLL >= 2 * WOKEN_WITHIN
    async with two(spec) as (holder, waiter):
        granted_at: list[float] = []

        async def wait_for_permit() -> None:
            sem = waiter.semaphore(lock_name, 1)
            async with sem.acquire(ttl=TTL, timeout=20):
                granted_at.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            permit_cm = holder.semaphore(lock_name, 1).acquire(ttl=TTL)
            permit = await permit_cm.__aenter__()
            try:
                tg.start_soon(wait_for_permit)
                released_at = await release_after_capped_backoff(waiter, permit.release)
            finally:
                await permit_cm.__aexit__(None, None, None)
        assert granted_at[0] - released_at < WOKEN_WITHIN, granted_at[0] - released_at


@pytest.mark.parametrize("spec", RW_NOTIFYING, indirect=True)
async def test_writer_woken_when_the_last_reader_releases_elsewhere(
    spec: BackendSpec, lock_name: str
) -> None:
    async with two(spec) as (holder, waiter):
        granted_at: list[float] = []

        async def write() -> None:
            async with waiter.rwlock(lock_name).write(ttl=TTL, timeout=20):
                granted_at.append(time.monotonic())

        rw = holder.rwlock(lock_name)
        async with anyio.create_task_group() as tg:
            first, second = rw.read(ttl=TTL), rw.read(ttl=TTL)
            r1, r2 = await first.__aenter__(), await second.__aenter__()
            try:
                tg.start_soon(write)
                await next_attempt(waiter, 0)
                await r1.release()  # one reader left: the writer stays out

                released_at = await release_after_capped_backoff(waiter, r2.release)
            finally:
                await second.__aexit__(None, None, None)
                await first.__aexit__(None, None, None)
        assert granted_at[0] - released_at < WOKEN_WITHIN, granted_at[0] - released_at


@pytest.mark.parametrize("spec", RW_NOTIFYING, indirect=True)
async def test_reader_woken_when_the_writer_releases_elsewhere(
    spec: BackendSpec, lock_name: str
) -> None:
    async with two(spec) as (holder, waiter):
        granted_at: list[float] = []

        async def read() -> None:
            async with waiter.rwlock(lock_name).read(ttl=TTL, timeout=20):
                granted_at.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            hold = holder.rwlock(lock_name).write(ttl=TTL)
            written = await hold.__aenter__()
            try:
                tg.start_soon(read)
                released_at = await release_after_capped_backoff(waiter, written.release)
            finally:
                await hold.__aexit__(None, None, None)
        assert granted_at[0] - released_at < WOKEN_WITHIN, granted_at[0] - released_at


@pytest.mark.parametrize("spec", RW_NOTIFYING, indirect=True)
async def test_reader_woken_when_a_waiting_writer_gives_up_elsewhere(
    spec: BackendSpec, lock_name: str
) -> None:
    """A waiting writer's intent keeps new readers out; when it gives up (its intent
    withdrawn), a reader waiting on another backend is woken at once."""
    async with two(spec) as (holder, waiter), spec.connect() as writer:
        granted_at: list[float] = []
        gave_up = anyio.Event()
        giving_up = anyio.CancelScope()

        async def write() -> None:
            with giving_up:
                async with writer.rwlock(lock_name).write(ttl=TTL, timeout=20):
                    pass
            gave_up.set()  # cancelled while waiting: its intent withdrawn

        async def read() -> None:
            async with waiter.rwlock(lock_name).read(ttl=TTL, timeout=20):
                granted_at.append(time.monotonic())

        async def give_up() -> None:
            giving_up.cancel()
            with anyio.fail_after(5):
                await gave_up.wait()

        async with anyio.create_task_group() as tg:
            reading = holder.rwlock(lock_name).read(ttl=TTL)
            await reading.__aenter__()  # the writer waits for this reader
            try:
                tg.start_soon(write)
                await next_attempt(writer, 0)  # its intent is recorded
                tg.start_soon(read)  # kept out by the intent, not by the reader
                released_at = await release_after_capped_backoff(waiter, give_up)
            finally:
                await reading.__aexit__(None, None, None)
        assert granted_at[0] - released_at < WOKEN_WITHIN, granted_at[0] - released_at
