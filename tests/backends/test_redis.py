"""What is particular to the single-node ``redis://`` backend, against real servers."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio
from redis.crc import key_slot

import asynclock
import asynclock.testing
from asynclock._core.acquisition import DEFAULT_POLL
from asynclock._core.renewer import Renewer
from asynclock.backends.redis import RedisDriver, keys_for
from asynclock.backends.redis.deadlines import Deadlines
from asynclock.backends.redis.options import display_url
from tests.support.procs import start_worker
from tests.support.redis_servers import RedisFactory, RedisServer, wait_until
from tests.support.signals import BusyWatch
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def crc16(data: bytes) -> int:
    """CRC16-XMODEM, as Redis Cluster computes it (written out here, not imported)."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def cluster_slot(key: str) -> int:
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc16(raw) % 16384


def raw_client(server: RedisServer) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(server.url)


async def _queued(client: redis.asyncio.Redis, key: str) -> bool:
    return int(await client.zcard(key)) >= 1


async def _queued_n(client: redis.asyncio.Redis, key: str, n: int) -> bool:
    return int(await client.zcard(key)) >= n


async def commands(client: redis.asyncio.Redis, name: str) -> int:
    stats = await client.info("commandstats")
    entry = stats.get(f"cmdstat_{name}")
    return int(entry["calls"]) if entry else 0


@pytest.mark.parametrize(
    "name", ["invoice:42", "{user1}:x", "}starts-with-brace", "a{}b", "50%{x}", "ünï"]
)
def test_all_keys_of_a_lock_share_one_hash_slot(name: str) -> None:
    k = keys_for(name)
    keys = [k.lock, k.fence, k.queue, k.queue_exp]
    assert len({cluster_slot(key) for key in keys}) == 1, keys
    assert len({key_slot(key.encode()) for key in keys}) == 1, keys


def test_distinct_names_get_distinct_keys() -> None:
    names = ["a}", "a%7D", "a{", "a%7B", "a%", "a%25", "a"]
    assert len({keys_for(n).lock for n in names}) == len(names)


def test_display_never_shows_the_password() -> None:
    assert display_url("redis://bob:s3cret@h:6380/2") == "redis://bob@h:6380/2"
    assert "s3cret" not in display_url("rediss://:s3cret@h")
    assert display_url("unix:///tmp/r.sock?db=1&password=s3cret") == "unix:///tmp/r.sock"


async def test_acquire_and_release_are_one_command_each(
    redis_server: RedisServer, lock_name: str
) -> None:
    client = raw_client(redis_server)
    async with asynclock.connect(redis_server.url) as backend:
        before = await commands(client, "evalsha")
        async with backend.lock(lock_name, ttl=5.0) as lease:
            assert await backend.validate(lock_name, lease.token)
            assert not await backend.validate(lock_name, lease.token - 1)
        assert await commands(client, "evalsha") - before == 2
        assert not await backend.validate(lock_name, lease.token)
    await client.aclose()


async def test_scripts_are_reloaded_after_script_flush(
    redis_server: RedisServer, lock_name: str
) -> None:
    client = raw_client(redis_server)
    async with asynclock.connect(redis_server.url) as backend:
        async with backend.lock(lock_name, ttl=5.0):
            pass
        await client.script_flush()
        async with backend.lock(lock_name, ttl=5.0):
            pass
    await client.aclose()


@pytest.mark.timeout(10)
async def test_deadlines_behave_like_asyncio_timeout_at() -> None:
    """One timer for many calls: each call still times out at its own deadline, an earlier
    deadline moves the timer, and a cancellation from outside is not turned into a
    TimeoutError."""
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    never = asyncio.Event()

    started = loop.time()
    with pytest.raises(TimeoutError), deadlines.at(started + 0.05):
        await never.wait()
    assert loop.time() - started >= 0.05
    assert task.cancelling() == 0 and not deadlines._calls

    # A long deadline is armed first; a nested, earlier one must still fire on time.
    started = loop.time()
    with deadlines.at(started + 30):
        with pytest.raises(TimeoutError), deadlines.at(started + 0.05):
            await never.wait()
        assert loop.time() - started < 5
    # The outer one fires while the inner (later) one is waiting: the outer times out.
    with pytest.raises(TimeoutError), deadlines.at(loop.time() + 0.05):
        with deadlines.at(loop.time() + 30):
            await never.wait()
    assert task.cancelling() == 0 and not deadlines._calls

    # Past deadline: a call that does not wait completes; one that waits times out.
    with deadlines.at(loop.time() - 1):
        pass
    with pytest.raises(TimeoutError), deadlines.at(loop.time() - 1):
        await never.wait()

    # Concurrent calls with different deadlines: each times out at its own.
    ended: dict[str, float] = {}

    async def call(label: str, after: float) -> None:
        with contextlib.suppress(TimeoutError), deadlines.at(loop.time() + after):
            await never.wait()
        ended[label] = loop.time()

    started = loop.time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "late", 0.2)
        tg.start_soon(call, "early", 0.05)
    assert 0.05 <= ended["early"] - started < ended["late"] - started
    assert ended["late"] - started >= 0.2

    # Cancelled from outside (an anyio scope): CancelledError, not TimeoutError.
    with anyio.move_on_after(0.05) as scope, deadlines.at(loop.time() + 30):
        await never.wait()
    assert scope.cancelled_caught
    assert task.cancelling() == 0 and not deadlines._calls


@pytest.mark.parametrize("reader", ["hiredis", "redis-py", "resp3"])
async def test_replies_and_error_replies_on_every_reply_path(
    redis_server: RedisServer, lock_name: str, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies are parsed with hiredis straight from the connection when it is installed,
    else (or on RESP3, asked for in the URL) by redis-py's public ``read_response``: the
    same answers, NOSCRIPT reloads, and an error reply leaves the connection usable."""
    import asynclock.backends.redis.wire as module

    url = redis_server.url
    if reader == "hiredis":
        assert module._hiredis is not None, "hiredis is a dev dependency: the fast path is tested"
    elif reader == "redis-py":
        monkeypatch.setattr(module, "_hiredis", None)
    else:
        url += "?protocol=3"
    client = raw_client(redis_server)
    key = keys_for(lock_name).lock
    try:
        async with asynclock.connect(url) as backend:
            driver = backend.driver
            assert isinstance(driver, RedisDriver)
            async with backend.lock(lock_name, ttl=5.0) as first:
                assert await backend.validate(lock_name, first.token)
            wires = driver.node._idle
            assert wires
            assert all((w.parser is not None) == (reader == "hiredis") for w in wires)
            await client.script_flush()
            async with backend.lock(lock_name, ttl=5.0) as second:  # NOSCRIPT: loaded again
                assert second.token == first.token + 1
            await client.rpush(key, "not a lock")
            with pytest.raises(asynclock.BackendUnavailable, match="WRONGTYPE"):
                async with backend.lock(lock_name, ttl=5.0):
                    pass
            await client.delete(key)
            async with backend.lock(lock_name, ttl=5.0) as third:
                assert third.token == second.token + 1
    finally:
        await client.aclose()


async def test_unix_socket_and_database_number(redis_factory: RedisFactory) -> None:
    server = redis_factory(unixsocket=True)
    url = f"unix://{server.socket_path}?db=3"
    async with asynclock.connect(url) as backend:
        assert backend.driver.display == f"unix://{server.socket_path}"
        async with backend.lock("u", ttl=5.0) as lease:
            client = redis.asyncio.Redis.from_url(url)
            assert await client.exists(keys_for("u").lock) == 1
            other = redis.asyncio.Redis.from_url(server.url)
            assert await other.exists(keys_for("u").lock) == 0
            await client.aclose()
            await other.aclose()
            assert lease.token > 0


async def test_password_and_wrong_password(redis_factory: RedisFactory) -> None:
    secret = "correct-horse-battery"
    server = redis_factory(password=secret)
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("auth", ttl=5.0) as lease:
            assert lease.token > 0
        assert secret not in repr(backend) and secret not in backend.driver.display
    for url in (
        f"redis://:wrong-{secret}@127.0.0.1:{server.port}/0",
        f"redis://127.0.0.1:{server.port}/0",
    ):
        with pytest.raises(asynclock.BackendUnavailable) as info:
            async with asynclock.connect(url):
                pass
        message = str(info.value)
        assert "authentication failed" in message
        assert secret not in message and "wrong-" not in message


async def test_unreachable_server_is_a_clear_error() -> None:
    from tests.support.redis_servers import free_port

    started = time.monotonic()
    with pytest.raises(asynclock.BackendUnavailable, match=r"redis://127\.0\.0\.1:\d+/0"):
        async with asynclock.connect(f"redis://127.0.0.1:{free_port()}/0"):
            pass
    assert time.monotonic() - started < 5


async def test_missing_driver_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.delitem(sys.modules, "asynclock.backends.redis", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "asynclock\[redis\]"'):
        asynclock.connect("redis://localhost")


async def test_release_hands_off_at_once_without_polling(
    redis_server: RedisServer, lock_name: str
) -> None:
    """A waiter behind a 30 s lease gets the lock right after release (pub/sub, no PTTL wait)."""
    async with (
        asynclock.connect(redis_server.url) as a,
        asynclock.connect(redis_server.url) as b,
    ):
        lease = await a.acquire(lock_name, ttl=30.0)
        waiting = anyio.Event()
        got: list[float] = []

        async def waiter() -> None:
            waiting.set()
            async with b.lock(lock_name, ttl=5.0, timeout=10):
                got.append(time.monotonic())

        busy = BusyWatch(b)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await waiting.wait()
            await busy.reached(2)  # queued, subscribed
            released = time.monotonic()
            await lease.release()
        assert got[0] - released < 0.5


async def test_a_subscribed_waiter_asks_once_then_waits(
    redis_server: RedisServer, lock_name: str
) -> None:
    """Already subscribed before its attempt, a waiter needs no second look (watch() says
    nothing can have been missed): busy, claim after the handoff, release."""
    client = raw_client(redis_server)
    async with (
        asynclock.connect(redis_server.url) as a,
        asynclock.connect(redis_server.url) as b,
    ):
        used = []
        busy = BusyWatch(b)
        for _ in range(2):  # the first round subscribes b (the subscription is kept)
            lease = await a.acquire(lock_name, ttl=30.0)
            before = await commands(client, "evalsha")
            attempts = b.stats().busy_attempts
            got = anyio.Event()

            async def waiter(got: anyio.Event = got) -> None:
                async with b.lock(lock_name, ttl=30.0, timeout=10):
                    got.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await busy.reached(attempts + 1)
                await lease.release()
                await got.wait()
            used.append(await commands(client, "evalsha") - before)
        # b: busy + claim + release, a: release.
        assert used[1] == 4, used
        assert b.stats().busy_attempts - attempts == 1
    await client.aclose()


async def test_waiters_are_served_in_arrival_order(
    redis_server: RedisServer, lock_name: str
) -> None:
    async with asynclock.connect(redis_server.url) as holder:
        lease = await holder.acquire(lock_name, ttl=10.0)
        order: list[int] = []
        async with contextlib.AsyncExitStack() as stack:
            backends = [
                await stack.enter_async_context(asynclock.connect(redis_server.url))
                for _ in range(4)
            ]
            async with anyio.create_task_group() as tg:
                for i, b in enumerate(backends):

                    async def wait(i: int = i, b: asynclock.Backend = b) -> None:
                        async with b.lock(lock_name, ttl=5.0, timeout=10):
                            order.append(i)

                    busy = BusyWatch(b)
                    tg.start_soon(wait)
                    await busy.reached(1)  # i is queued
                await lease.release()
        assert order == [0, 1, 2, 3]


async def test_a_dead_waiter_delays_the_name_at_most_about_its_ttl(
    redis_server: RedisServer, lock_name: str
) -> None:
    """A waiter killed with -9 while queued must not block the lock for ever."""
    spec = BackendSpec("redis", redis_server.url, lambda b, n: anyio.lowlevel.checkpoint())
    client = raw_client(redis_server)
    async with asynclock.connect(redis_server.url) as backend:
        lease = await backend.acquire(lock_name, ttl=10.0)
        worker = await start_worker(spec, mode="hold", name=lock_name, ttl=0.5)
        k = keys_for(lock_name)
        await wait_until(lambda: _queued(client, k.queue))  # the worker is queued
        worker.signal(__import__("signal").SIGKILL)
        await worker.wait()
        await lease.release()  # hands the name to the dead worker for its ttl (0.5 s)
        started = time.monotonic()
        async with backend.lock(lock_name, ttl=5.0, timeout=5):
            waited = time.monotonic() - started
    await client.aclose()
    assert waited < 0.5 + 0.5


async def test_a_killed_waiter_does_not_stall_the_live_waiter_behind_it(
    redis_server: RedisServer, lock_name: str
) -> None:
    """Issue 8 item 10, reproduced: a queued waiter that died was handed the free name for
    its own ttl (here 5 s) while a live waiter behind it waited. Now its probe channel has
    no subscriber once its connection is gone, so the release skips it and hands the name
    to the live waiter within one notification."""
    spec = BackendSpec("redis", redis_server.url, lambda b, n: anyio.lowlevel.checkpoint())
    client = raw_client(redis_server)
    k = keys_for(lock_name)
    async with (
        asynclock.connect(redis_server.url) as holder,
        asynclock.connect(redis_server.url) as live,
    ):
        lease = await holder.acquire(lock_name, ttl=10.0)
        worker = await start_worker(spec, mode="hold", name=lock_name, ttl=5.0)

        async def probe_of_queued_worker() -> bytes | None:
            members = await client.zrange(k.queue, 0, 0)
            parts = members[0].split(b":") if members and isinstance(members[0], bytes) else []
            return parts[2] if len(parts) == 3 else None

        async def worker_queued_with_probe() -> bool:
            return await probe_of_queued_worker() is not None

        await wait_until(worker_queued_with_probe, timeout=30)
        probe = await probe_of_queued_worker()
        assert probe is not None
        got: list[float] = []

        async def waiter() -> None:
            async with live.lock(lock_name, ttl=5.0, timeout=20):
                got.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await wait_until(lambda: _queued_n(client, k.queue, 2))  # behind the worker
            worker.signal(__import__("signal").SIGKILL)
            await worker.wait()

            async def probe_gone() -> bool:
                numsub = await client.pubsub_numsub(b"asynclock:w:" + probe)
                return int(numsub[0][1]) == 0

            await wait_until(probe_gone)  # the server has seen the connection close
            released = time.monotonic()
            await lease.release()
    await client.aclose()
    assert got[0] - released < 0.25, got[0] - released  # one notification, not 5 s


async def test_a_key_without_expiry_makes_waiters_poll_not_hammer(
    redis_server: RedisServer, lock_name: str
) -> None:
    """Issue 8 item 9, reproduced: a lock key with no expiry (PTTL -1, left by another tool)
    gave retry_after 0: one waiter sent thousands of commands a second, and LockHeld said
    "it frees in at most 0.000s". Now "no expiry" is unknown: the waiter polls at the
    core's poll interval, and the message says so."""
    client = raw_client(redis_server)
    key = keys_for(lock_name).lock
    await client.set(key, "legacy-tool:1")  # no PX
    async with asynclock.connect(redis_server.url) as backend:
        with pytest.raises(asynclock.LockHeld, match="no expiry") as info:
            await backend.acquire(lock_name, ttl=5.0, blocking=False)
        assert "frees in at most" not in str(info.value)
        assert info.value.retry_after is None
        window = 1.0
        before = await commands(client, "evalsha")
        with pytest.raises(asynclock.AcquireTimeout):
            await backend.acquire(lock_name, ttl=5.0, timeout=window)
        used = await commands(client, "evalsha") - before
        # About one attempt per poll interval (50 ms): ~20 in the window, not thousands.
        assert used <= window / DEFAULT_POLL * 1.5 + 5, used
        got = anyio.Event()

        async def waiter() -> None:
            async with backend.lock(lock_name, ttl=5.0, timeout=10):
                got.set()

        busy = BusyWatch(backend)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await busy.reached(busy.count + 1)
            await client.delete(key)  # the other tool lets go: found within a poll
            with anyio.fail_after(5):
                await got.wait()
    await client.aclose()


async def test_restart_with_data_loss_tokens_still_increase(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory()
    async with asynclock.connect(server.url) as backend:
        for _ in range(3):
            async with backend.lock("restart", ttl=5.0) as lease:
                before = lease.token
    server.restart(keep_data=False)
    client = raw_client(server)
    assert await client.dbsize() == 0  # the counter really is gone
    await client.aclose()
    async with asynclock.connect(server.url, restart_grace=0.1) as backend:
        async with backend.lock("restart", ttl=5.0) as lease:
            assert lease.token > before


async def test_restart_with_data_loss_scope_tokens_still_increase(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory()
    async with asynclock.connect(server.url) as backend:
        for i in range(3):
            async with backend.lock(f"occurrence@{i}", ttl=5.0, token_scope="job") as lease:
                before = lease.token
    server.restart(keep_data=False)
    async with asynclock.connect(server.url) as backend:
        # The scope's counter is gone too: seeded from TIME, the next one is still above.
        async with backend.lock("occurrence@new", ttl=5.0, token_scope="job") as lease:
            assert lease.token > before


async def test_kill_9_while_held_loses_the_lease_then_recovers(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory()
    async with asynclock.connect(server.url, socket_timeout=0.2) as backend:
        lease = await backend.acquire("kill", ttl=1.0)
        server.kill()
        reason = await lease.lost
        # Lost no later than the local deadline, before the server could hand it on.
        assert backend.clock.now() < lease.acquired_at + 1.0
        assert "deadline" in reason or "renewal" in reason
        assert not await lease.release()
        server.start()
        async with backend.lock("kill", ttl=1.0) as again:
            assert again.token > lease.token


async def test_a_renewal_that_meets_the_restarted_server_first_names_the_restart(
    redis_factory: RedisFactory,
) -> None:
    """Seen as a new user would: after a restart without persistence, a renewal that
    reached the new server before the pub/sub reconnect read its run_id lost the lease
    with "the lock key is gone (expired or deleted)", though the docs promise a reason
    naming the restart. The refused round now asks the server's run_id itself."""
    server = redis_factory()
    async with asynclock.connect(server.url) as backend:
        driver = backend.driver
        assert isinstance(driver, RedisDriver)
        listener = driver.listener
        read_run_id = listener._run_id
        resume = anyio.Event()
        stalled = anyio.Event()

        async def stalled_run_id(conn: object) -> str | None:
            stalled.set()
            await resume.wait()  # the reconnect says nothing until the renewal has
            return await read_run_id(conn)  # type: ignore[arg-type]

        lease = await backend.acquire("restart-reason", ttl=5.0)
        await wait_until(lambda: driver.node.run_id is not None)  # the listener connected
        listener._run_id = stalled_run_id  # type: ignore[method-assign]
        try:
            server.restart(keep_data=False)
            with anyio.fail_after(15):
                await stalled.wait()  # reconnected, its run_id not read yet
                reason = await lease.lost
        finally:
            resume.set()
        assert "the Redis server restarted (run_id" in reason, reason
        assert "the lock key is gone" in reason, reason
        assert not await lease.release()


async def test_a_restart_cancels_the_holder_at_the_reconnect_and_the_successor_waits(
    redis_factory: RedisFactory,
) -> None:
    """Issue 8 item 3, reproduced: after a kill -9 and a restart without persistence, a
    successor got the lock 0.21 s after the restart while the holder's body ran on until
    its next renewal. Now (a) the reconnect notices the new run_id and cancels the holder
    at once (its heartbeat is 10 s away), and (b) the wiped database grants no lock for the
    restart grace, so the successor comes after the holder has stopped."""
    server = redis_factory()
    grace = 1.0
    events: dict[str, float] = {}
    async with (
        asynclock.connect(server.url) as a,
        asynclock.connect(f"{server.url}?restart_grace={grace}") as b,
    ):
        holding = anyio.Event()
        restarted = anyio.Event()
        driver = a.driver
        assert isinstance(driver, RedisDriver)
        on_connect = driver.listener.on_connect
        assert on_connect is not None

        def seen(run_id: str | None, reconnected: bool) -> None:
            events.setdefault("connected", time.monotonic())  # the first after the restart
            on_connect(run_id, reconnected)

        async def holder() -> None:
            with pytest.raises(asynclock.LeaseLost) as info:
                async with a.lock("restart", ttl=30.0):
                    holding.set()
                    await anyio.sleep_forever()
            events["lost"] = time.monotonic()
            assert "restarted" in info.value.reason, info.value.reason

        async def successor() -> None:
            await restarted.wait()
            with pytest.raises(asynclock.LockHeld):
                await b.acquire("restart", ttl=5.0, blocking=False)
            async with b.lock("restart", ttl=5.0, timeout=20):
                events["granted"] = time.monotonic()

        with anyio.fail_after(8):  # the holder's first renewal would come at 10 s
            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await holding.wait()
                events.clear()
                driver.listener.on_connect = seen
                server.restart(keep_data=False)
                events["restarted"] = time.monotonic()
                restarted.set()
                tg.start_soon(successor)
    assert events["lost"] - events["restarted"] < 2.0, events
    # Lost right at the reconnect (no renewal round needed: the run_id said it all).
    assert events["lost"] - events["connected"] < 0.5, events
    assert events["granted"] - events["restarted"] >= grace * 0.99, events
    assert events["lost"] < events["granted"], events


async def test_no_lock_is_granted_for_the_grace_after_the_data_is_lost(
    redis_factory: RedisFactory,
) -> None:
    """Issue 8 item 3 (b): the epoch key is missing after a restart that lost the data: no
    grant for the first ttl asked for (the default grace), then as usual. (A FLUSHALL on a
    server up longer than the grace starts none: tests/backends/test_redis_grace.py.)"""
    server = redis_factory()
    client = raw_client(server)
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("g", ttl=1.0):  # a settled server: no wait
            pass
        server.restart(keep_data=False)
        started = time.monotonic()
        with pytest.raises(asynclock.RestartGrace, match=r"\((0\.9|1\.0)\d*s from now\)"):
            await backend.acquire("g", ttl=1.0, blocking=False)
        async with backend.lock("g", ttl=1.0, timeout=10):
            assert time.monotonic() - started >= 0.99
        started = time.monotonic()
        async with backend.lock("other", ttl=1.0, blocking=False):
            assert time.monotonic() - started < 0.5  # the grace is over for every name
    async with asynclock.connect(f"{server.url}?restart_grace=0") as backend:
        await client.flushall()
        async with backend.lock("g", ttl=5.0, blocking=False):  # 0 turns the grace off
            pass
    with pytest.raises(ValueError, match="restart_grace must be a finite number"):
        asynclock.connect(f"{server.url}?restart_grace=-1")
    with pytest.raises(ValueError, match="restart_grace must be a number of seconds"):
        asynclock.connect(server.url, restart_grace="soon")
    await client.aclose()


async def test_sigstop_node_times_out_and_nothing_hangs(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    async with asynclock.connect(server.url, socket_timeout=0.2) as backend:
        with pytest.raises(asynclock.LeaseLost):
            async with backend.lock("frozen", ttl=0.9) as lease:
                server.freeze()
                await anyio.sleep_forever()
        assert lease.lost.reason == "local deadline passed"
        try:
            started = time.monotonic()
            with pytest.raises(asynclock.BackendUnavailable, match="timed out"):
                await backend.acquire("frozen-2", ttl=5.0, timeout=1)
            assert time.monotonic() - started < 1.5
            with pytest.raises(asynclock.BackendUnavailable):
                await backend.validate("frozen-2", 1)
        finally:
            server.thaw()
        async with backend.lock("frozen-2", ttl=5.0) as lease:
            assert lease.token > 0


async def test_ten_thousand_leases_renewed_in_chunks_each_at_its_cadence(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 leases: each renewed once per interval (twice within two), in calls of at
    most ``renew_chunk`` leases (one EXTEND script each: the server is never blocked by
    one huge call), nearly all of them full: a round's leases go out as ceil(n / chunk)
    calls, and rounds are few (leases due within half an interval ride together)."""
    client = raw_client(redis_server)
    ttl = 3.0
    sizes: list[int] = []
    rounds: list[int] = []
    original = RedisDriver.extend
    original_round = Renewer._round

    async def counted(self: RedisDriver, refs: Any) -> Any:
        sizes.append(len(refs))
        return await original(self, refs)

    async def counted_round(self: Renewer, items: Any, now: float, late_by: float) -> int:
        rounds.append(len(items))
        return await original_round(self, items, now, late_by)

    monkeypatch.setattr(RedisDriver, "extend", counted)
    monkeypatch.setattr(Renewer, "_round", counted_round)
    async with asynclock.connect(redis_server.url) as backend:
        driver = backend.driver
        assert isinstance(driver, RedisDriver)
        chunk = driver.renew_chunk
        assert chunk is not None and chunk < 10_000
        with anyio.fail_after(60):
            leases = [await backend.acquire(f"many:{i}", ttl=ttl) for i in range(10_000)]
            before_calls = await commands(client, "evalsha")
            before, sizes[:], rounds[:] = backend.stats(), [], []
            start = anyio.current_time()
            while anyio.current_time() - start < 2 * ttl / 3 + 0.1:  # two intervals
                await asynclock.testing.next_renewal_round(backend)
        after = backend.stats()
        calls = await commands(client, "evalsha") - before_calls
        assert calls == len(sizes) == after.renewal_round_trips - before.renewal_round_trips
        assert max(sizes) <= chunk
        assert sum(sizes) == after.renewals - before.renewals >= 2 * 10_000
        # Every call full but the last of each round; rounds are few (leases due within
        # half an interval ride together), whatever the load.
        assert sum(1 for n in sizes if n < chunk) <= len(rounds), (sizes, rounds)
        assert len(rounds) < len(sizes)
        assert not any(lease.lost for lease in leases)
        assert after.losses == 0
        pttl = await client.pttl(keys_for("many:9999").lock)
        assert pttl > ttl * 1000 * 0.5
        for lease in leases[:100]:
            await lease.release()
    await client.aclose()


async def test_example_redis_fenced_write(redis_server: RedisServer) -> None:
    example = EXAMPLES / "redis_fenced_write.py"
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, str(example), redis_server.url], check=False
        )
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    lines = out.splitlines()
    assert lines[0].startswith("first holder wrote total=100 with token ")
    assert lines[1].startswith("second holder wrote total=200 with token ")
    assert "late write rejected: stale fencing token" in lines[2]
    assert lines[-1] == "invoice: total=200"


async def test_a_lease_the_restarted_server_granted_survives_the_first_pubsub_connect(
    redis_factory: RedisFactory,
) -> None:
    """Issue 21 (found by the APScheduler fleet tests): a backend opened before a restart
    (with persistence: no grace) got a lease from the restarted server; its pub/sub
    connection, opened for the first time after that, saw a run_id other than the one read
    at open and dropped every lease as 'the Redis server restarted', the new one too. Now
    the server is asked instead: a lease it granted is kept, one it lost is lost."""
    server = redis_factory(persist=True)
    async with asynclock.connect(server.url) as backend:
        driver = backend.driver
        assert isinstance(driver, RedisDriver)
        on_connect = driver.listener.on_connect
        assert on_connect is not None
        connected = anyio.Event()

        def seen(run_id: str | None, reconnected: bool) -> None:
            on_connect(run_id, reconnected)
            connected.set()

        driver.listener.on_connect = seen
        server.kill()
        server.start(settle=False)  # the data was kept (AOF), so no restart grace
        with anyio.fail_after(10):
            lease = await backend.acquire("after-restart", ttl=5.0)  # opens pub/sub
            await connected.wait()
            await asynclock.testing.next_renewal_round(backend)
        assert not lease.lost, lease.lost.reason
        assert await backend.validate("after-restart", lease.token)
        assert await lease.release()


def test_the_key_cache_keeps_every_held_name_while_many_are_held() -> None:
    """Each held name's keys are looked up once per renewal round: a cache bound below the
    number held emptied itself over and over and every renewal rebuilt its keys (issue 45:
    4x the CPU per lease at 10,000 held). A driver tells the cache how many it holds."""
    from asynclock.backends.redis.keys import KeyCache

    driver = RedisDriver("redis://127.0.0.1:1/0")
    assert driver.keys.held() == 0
    driver._leases.update({f"owner-{i}": (f"n{i}", 0) for i in range(10_000)})
    assert driver.keys.held() == 10_000
    cache = driver.keys
    first = [cache(f"n{i}") for i in range(10_000)]
    assert all(cache(f"n{i}") is first[i] for i in range(10_000))  # none rebuilt
    idle = KeyCache("asynclock:")  # holding nothing: bounded as before
    for i in range(KeyCache.LIMIT * 3):
        idle(f"n{i}")
    assert len(idle._cache) <= KeyCache.LIMIT
