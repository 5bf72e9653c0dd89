"""What is particular to the embedded SQLite backend."""

from __future__ import annotations

import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import asynclock
from asynclock.backends.sqlite import WAITER_TTL, SQLiteDriver
from tests.support.procs import start_worker
from tests.support.redis_servers import wait_until
from tests.support.signals import BusyWatch
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


def raw(url: str) -> sqlite3.Connection:
    return sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=5)


async def test_wal_and_synchronous_settings(url: str) -> None:
    async with asynclock.connect(url + "?synchronous=full") as backend:
        driver = backend.driver
        assert isinstance(driver, SQLiteDriver)
        assert driver.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert driver.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


async def test_relative_path_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with asynclock.connect("sqlite:///relative.db") as backend:
        async with backend.lock("x", ttl=5.0):
            pass
    assert (tmp_path / "relative.db").exists()


async def test_release_keeps_the_row_and_its_token(url: str) -> None:
    async with asynclock.connect(url) as backend:
        async with backend.lock("c", ttl=5.0) as first:
            pass
    conn = raw(url)
    rows = conn.execute("SELECT name, token, expires_at FROM asynclock_lease").fetchall()
    conn.close()
    assert rows == [("c", first.token, 0)]
    async with asynclock.connect(url) as backend:  # a new process sees the same counter
        async with backend.lock("c", ttl=5.0) as second:
            assert second.token == first.token + 1


async def test_rows_from_before_a_reboot_count_as_expired(url: str) -> None:
    async with asynclock.connect(url) as backend:
        pass
    conn = raw(url)
    # A lease written before a reboot: monotonic time restarted, so its expiry looks far off.
    conn.execute(
        "INSERT INTO asynclock_lease VALUES ('boot', 'someone', 7, ?, 'old-boot-id')",
        (time.monotonic() + 3600,),
    )
    conn.close()
    async with asynclock.connect(url) as backend:
        async with backend.lock("boot", ttl=5.0, blocking=False) as lease:
            assert lease.token == 8  # free again, and the token still goes up


async def test_busy_database_never_blocks_the_event_loop(url: str) -> None:
    async with asynclock.connect(url) as backend:
        blocker = raw(url)
        blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        ticks = 0
        enough = anyio.Event()
        acquired = anyio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not acquired.is_set():
                ticks += 1
                if ticks == 20:
                    enough.set()
                await anyio.lowlevel.checkpoint()

        async def take() -> None:
            async with backend.lock("busy", ttl=5.0):
                acquired.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(take)
            await enough.wait()  # the loop kept running while the database was locked
            assert not acquired.is_set()
            blocker.execute("COMMIT")
        blocker.close()


async def test_busy_timeout_gives_a_clear_error(url: str) -> None:
    async with asynclock.connect(url + "?busy_timeout=0.05") as backend:
        blocker = raw(url)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(asynclock.BackendUnavailable, match="busy_timeout"):
                await backend.acquire("stuck", ttl=5.0)
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        async with backend.lock("stuck", ttl=5.0, blocking=False):
            pass  # usable again once the other writer is done


async def test_waiters_are_served_first_come_first_served(url: str) -> None:
    order: list[str] = []
    async with (
        asynclock.connect(url) as holder,
        asynclock.connect(url) as first,
        asynclock.connect(url) as second,
    ):
        queued = {"first": BusyWatch(first), "second": BusyWatch(second)}

        async def wait(label: str, backend: asynclock.Backend) -> None:
            async with backend.lock("fifo", ttl=5.0, timeout=10):
                order.append(label)

        async with holder.lock("fifo", ttl=5.0):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait, "first", first)
                await queued["first"].reached(1)
                tg.start_soon(wait, "second", second)
                await queued["second"].reached(1)
                # A newcomer may not barge ahead of the queue, even once the name is free.
                await holder.held()[0].release()
                with pytest.raises(asynclock.LockHeld):
                    async with holder.lock("fifo", ttl=5.0, blocking=False):
                        order.append("barged")
    assert order == ["first", "second"]


async def test_a_dead_waiter_does_not_block_the_queue(url: str) -> None:
    async with asynclock.connect(url) as backend:
        async with backend.lock("q", ttl=5.0):
            pass  # the name has a row, as it does whenever someone could be queued
        conn = raw(url)
        driver = backend.driver
        assert isinstance(driver, SQLiteDriver)
        conn.execute(
            "INSERT INTO asynclock_waiter VALUES ('q', 'ghost', 0, ?, ?, NULL)",
            (time.monotonic() + WAITER_TTL, driver.boot),
        )
        conn.close()
        with pytest.raises(asynclock.LockHeld):
            await backend.acquire("q", ttl=5.0, blocking=False)
        started = time.monotonic()
        async with backend.lock("q", ttl=5.0, timeout=10):
            assert time.monotonic() - started <= WAITER_TTL + 0.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
async def test_a_killed_waiter_does_not_stall_the_live_waiter_behind_it(url: str) -> None:
    """Issue 8 item 10 on SQLite: a waiter process killed with -9 kept its place for up to
    WAITER_TTL. Now the release finds nobody listening on its wake address, drops its place
    and wakes the live waiter behind it at once."""
    spec = BackendSpec("sqlite", url, lambda b, n: anyio.lowlevel.checkpoint())
    conn = raw(url)

    def queued(n: int) -> Callable[[], bool]:
        def check() -> bool:
            rows = conn.execute("SELECT count(*) FROM asynclock_waiter WHERE name = 'k'")
            return bool(rows.fetchone()[0] >= n)

        return check

    async with asynclock.connect(url) as holder, asynclock.connect(url) as live:
        lease = await holder.acquire("k", ttl=10.0)
        worker = await start_worker(spec, mode="hold", name="k", ttl=5.0)
        await wait_until(queued(1), timeout=30)
        got: list[float] = []

        async def waiter() -> None:
            async with live.lock("k", ttl=5.0, timeout=20):
                got.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_until(queued(2))  # behind the worker
            worker.signal(signal.SIGKILL)
            await worker.wait()
            released = time.monotonic()
            await lease.release()
    conn.close()
    assert got[0] - released < 0.25, got[0] - released  # one notification, not WAITER_TTL


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux-only")
async def test_release_wakes_the_next_waiter_in_another_backend(url: str) -> None:
    """Handoff across processes does not wait for a poll: the releaser sends a datagram."""
    async with asynclock.connect(url) as holder, asynclock.connect(url) as waiter:
        woken: list[str] = []
        wake = waiter.driver._wake

        def record(name: str, owner: str | None = None, /) -> None:
            woken.append(name)
            wake(name, owner)

        waiter.driver._wake = record
        queued = BusyWatch(waiter)
        got = anyio.Event()

        async def wait() -> None:
            async with waiter.lock("handoff", ttl=5.0, timeout=10):
                got.set()

        lease = await holder.acquire("handoff", ttl=5.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await queued.reached(1)
            assert await lease.release()
            await got.wait()
        assert "handoff" in woken


async def test_a_backend_queues_one_row_per_name_however_many_of_its_tasks_wait(
    url: str,
) -> None:
    """Issue 45 item 5: 10,000 waiters in 10 processes failed on SQLite (joins raised
    BackendUnavailable after busy_timeout): each waiting task wrote its own queue row, so
    10,000 joins fought over the file's write lock, and each backend's place keeper
    rewrote every row of its tasks three times a second. A backend's tasks now wait in a
    line of its own; only the first of them has a row in the file."""
    async with asynclock.connect(url) as holder, asynclock.connect(url) as waiting:
        queued = BusyWatch(waiting)
        done: list[int] = []

        async def wait(i: int) -> None:
            async with waiting.lock("many", ttl=5.0, timeout=30):
                done.append(i)

        lease = await holder.acquire("many", ttl=10.0)
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(wait, i)
            await queued.reached(200)
            conn = raw(url)
            rows = conn.execute("SELECT count(*) FROM asynclock_waiter").fetchone()[0]
            conn.close()
            assert rows == 1
            await lease.release()
        assert done == list(range(200))  # first come, first served within the backend


async def test_interleaved_waiters_of_two_backends_are_served_in_arrival_order(url: str) -> None:
    """A backend's tasks queue in a line of their own (one row per name in the file), yet
    the order across backends stays first come, first served: a task that waited behind
    its backend's first keeps its arrival time, not the back of the file's queue."""
    order: list[str] = []
    async with (
        asynclock.connect(url) as holder,
        asynclock.connect(url) as a,
        asynclock.connect(url) as b,
    ):
        watches = {"a": BusyWatch(a), "b": BusyWatch(b)}
        backends = {"a": a, "b": b}
        seen = {"a": 0, "b": 0}

        async def wait(label: str) -> None:
            async with backends[label[0]].lock("fifo", ttl=5.0, timeout=20):
                order.append(label)

        lease = await holder.acquire("fifo", ttl=10.0)
        async with anyio.create_task_group() as tg:
            for label in ("a1", "b1", "a2", "b2", "a3"):
                tg.start_soon(wait, label)
                seen[label[0]] += 1
                await watches[label[0]].reached(seen[label[0]])
            await lease.release()
    assert order == ["a1", "b1", "a2", "b2", "a3"]


async def test_the_next_of_a_line_keeps_its_arrival_order_when_the_first_gives_up(
    url: str,
) -> None:
    """The first of a backend's line cancelled: the next of that line takes a row in the
    file by its own arrival time, ahead of a later waiter of another backend, and the
    cancelled one leaves no row behind."""
    order: list[str] = []
    async with (
        asynclock.connect(url) as holder,
        asynclock.connect(url) as a,
        asynclock.connect(url) as b,
    ):
        watch_a, watch_b = BusyWatch(a), BusyWatch(b)

        async def wait(label: str, backend: asynclock.Backend) -> None:
            async with backend.lock("give-up", ttl=5.0, timeout=20):
                order.append(label)

        lease = await holder.acquire("give-up", ttl=10.0)
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as first:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(wait, "a1", a)
                    await watch_a.reached(1)
                    tg.start_soon(wait, "a2", a)
                    await watch_a.reached(2)
                    tg.start_soon(wait, "b1", b)
                    await watch_b.reached(1)
                    first.cancel()
            conn = raw(url)
            rows = conn.execute("SELECT owner FROM asynclock_waiter ORDER BY seq").fetchall()
            conn.close()
            assert len(rows) == 2  # a2's and b1's: a1's is gone
            await lease.release()
    assert order == ["a2", "b1"]
