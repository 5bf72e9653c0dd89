"""What is particular to the PostgreSQL backend (both modes), against a real server."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock.backends.postgres import (
    KEY_SQL,
    SQL_S_RELEASE,
    TOKEN_RESERVE,
    PoolerDetected,
    PostgresDriver,
    ensure_schema,
    lock_key,
    notify_channel,
    waiter_key,
    xact_lock,
)
from asynclock.fence import SQLFence
from tests.support.pg_servers import PASSWORD, PgBouncer, PgServer, running_pg

pytestmark = pytest.mark.anyio

MODES = ["session", "lease"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def url_for(server: PgServer, mode: str) -> str:
    return server.url() + ("?mode=lease" if mode == "lease" else "")


@pytest.fixture
def name() -> str:
    return f"pg:{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def admin(pg_server: PgServer) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_server.admin_url)
    try:
        yield conn
    finally:
        await conn.close()


def pinned_pid(backend: asynclock.Backend) -> int:
    driver = backend.driver
    assert isinstance(driver, PostgresDriver) and driver._conn is not None
    pid: int = driver._conn.get_server_pid()
    return pid


# -- the key -----------------------------------------------------------------------------


async def test_lock_key_is_the_documented_sha256_prefix(
    admin: asyncpg.Connection,
) -> None:
    names = ["invoice:42", "lock-2", "lock-137", "ünïcödé ✓", "x" * 512, "'; --"]
    for n in names:
        assert await admin.fetchval(f"SELECT {KEY_SQL}", n) == lock_key(n)
    assert lock_key("lock-2") != lock_key("lock-137")  # tooz's 16-bit keys collide here


# -- loss ---------------------------------------------------------------------------------


async def test_terminated_backend_cancels_holder_within_one_interval(
    pg_server: PgServer, admin: asyncpg.Connection, name: str
) -> None:
    ttl = 1.5
    async with asynclock.connect(pg_server.url()) as backend:
        with pytest.raises(asynclock.LeaseLost) as info:
            async with backend.lock(name, ttl=ttl) as lease:
                first = lease.token
                killed_at = time.monotonic()
                assert await admin.fetchval("SELECT pg_terminate_backend($1)", pinned_pid(backend))
                await anyio.sleep_forever()
        lost_after = time.monotonic() - killed_at
        assert lost_after < ttl * backend.heartbeat, lost_after
        assert "connection" in info.value.reason
        # The server freed the key with the session; the same backend reconnects.
        async with backend.lock(name, ttl=ttl, blocking=False) as successor:
            assert successor.token > first


async def test_server_restart_loses_holders_and_tokens_keep_rising(
    pg_server: PgServer, name: str
) -> None:
    async with (
        asynclock.connect(pg_server.url()) as session,
        asynclock.connect(url_for(pg_server, "lease")) as lease_backend,
    ):
        async with session.lock(name, ttl=3.0) as before:
            pass
        with anyio.fail_after(20), pytest.raises(asynclock.LeaseLost) as info:
            async with session.lock(name, ttl=3.0) as held:
                assert held.token > before.token
                await anyio.to_thread.run_sync(pg_server.restart)
                await anyio.sleep_forever()
        assert "connection" in info.value.reason
        async with session.lock(name, ttl=3.0, blocking=False) as after:
            assert after.token > held.token
        # The lease table keeps its rows and its sequence across the restart.
        async with lease_backend.lock(name, ttl=3.0) as one:
            pass
        async with lease_backend.lock(name, ttl=3.0) as two:
            assert two.token > one.token


@pytest.fixture
def crashable_pg() -> Iterator[PgServer]:
    """A server of its own that this test may crash. ``synchronous_commit = off`` for every
    session (the hardest case: the reservation must force its own flush) and a 10 s
    ``wal_writer_delay``, so the WAL of asynchronous commits sits in shared memory and an
    immediate shutdown really loses it."""
    with running_pg("asynclock-pg-crash-", "wal_writer_delay = 10000ms\n") as server:
        yield server


async def test_tokens_keep_rising_across_a_server_crash(crashable_pg: PgServer) -> None:
    """G2 across a crash: tokens are committed without a WAL flush, so an immediate
    shutdown (no checkpoint, WAL buffers lost, crash recovery at start) loses the newest
    ones; every token after the restart must still exceed every token before it."""
    before: dict[str, int] = {}
    async with asynclock.connect(crashable_pg.url()) as backend:

        async def take(name: str) -> None:
            async with backend.lock(name, ttl=5.0, blocking=False) as lease:
                assert lease.token > before.get(name, 0)
                before[name] = lease.token

        # "middle" stops halfway through a reservation, "edge" right after taking a new
        # one (a synchronous commit), "xact" uses xact_lock. The last acquisitions come
        # just before the crash, so their commits are still in the WAL page it loses.
        conn = await asyncpg.connect(crashable_pg.url())
        try:
            await conn.execute("SET synchronous_commit = on")
            await conn.execute("CREATE TABLE control (n int); INSERT INTO control VALUES (0)")
            await conn.execute("SET synchronous_commit = off")
            for _ in range(TOKEN_RESERVE + TOKEN_RESERVE // 2 - 5):
                await take("middle")
            for _ in range(2 * TOKEN_RESERVE):
                await take("edge")
            for _ in range(3):
                async with conn.transaction():
                    before["xact"] = await xact_lock(conn, "xact")
            await take("edge")
            for _ in range(5):
                await take("middle")
            # Control: an ordinary asynchronous commit just before the crash must be lost.
            await conn.execute("UPDATE control SET n = 1")
        finally:
            await conn.close()
        assert before["edge"] == 2 * TOKEN_RESERVE + 1
        await anyio.to_thread.run_sync(crashable_pg.stop, "immediate")
        await anyio.to_thread.run_sync(crashable_pg.start)
        after: dict[str, int] = {}
        for name in before:
            async with backend.lock(name, ttl=5.0, timeout=10) as lease:
                after[name] = lease.token
    conn = await asyncpg.connect(crashable_pg.url())
    try:
        lost_control = await conn.fetchval("SELECT n FROM control") == 0
    finally:
        await conn.close()
    assert lost_control, "the crash lost no asynchronous commit, so it proves nothing"
    for name in before:
        assert after[name] > before[name], (name, before[name], after[name])


async def test_released_lock_wakes_a_waiter_via_notify(pg_server: PgServer, name: str) -> None:
    for mode in MODES:
        await check_notify_wakes_waiter(url_for(pg_server, mode), name + mode)


async def check_notify_wakes_waiter(url: str, key: str) -> None:
    # poll=30: only a NOTIFY can wake the waiter before the test times out.
    async with asynclock.connect(url, poll=30.0) as a, asynclock.connect(url, poll=30.0) as b:
        got = anyio.Event()
        listening = anyio.Event()
        driver = b.driver
        assert isinstance(driver, PostgresDriver)
        real_watch = driver.watch

        async def watch(n: str) -> None:
            await real_watch(n)
            listening.set()

        setattr(driver, "watch", watch)  # noqa: B010

        async def waiter() -> None:
            async with b.lock(key, ttl=5.0, timeout=10):
                got.set()

        holder = await a.acquire(key, ttl=30.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await listening.wait()
            started = time.monotonic()
            await holder.release()
            with anyio.fail_after(5):
                await got.wait()
            assert time.monotonic() - started < 2.0


async def test_release_notifies_only_when_a_waiter_announced_itself(
    pg_server: PgServer, admin: asyncpg.Connection, name: str
) -> None:
    """NOTIFY costs a transaction id and a commit, so an uncontended release skips it; a
    backend that waits holds the waiter key shared (from its LISTEN until unwatch), and
    then the release notifies and the waiter hears it."""
    key, channel, (high, low) = lock_key(name), notify_channel(name), waiter_key(name)
    conn = await asyncpg.connect(pg_server.url())
    try:
        async with asynclock.connect(pg_server.url()) as backend:
            driver = backend.driver
            assert isinstance(driver, PostgresDriver)
            heard = anyio.Event()
            setattr(driver, "_wake", lambda n: heard.set() if n == name else None)  # noqa: B010

            async def cycle() -> bool | None:
                assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", key)
                notified: bool | None = await conn.fetchval(SQL_S_RELEASE, key, channel, high, low)
                return notified

            assert await cycle() is False  # held, nobody waits: no NOTIFY
            assert await conn.fetchval(SQL_S_RELEASE, key, channel, high, low) is None
            assert await driver.watch(name)
            shared = await admin.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
                " AND mode = 'ShareLock' AND granted AND classid = $1::bigint::oid"
                " AND objid = $2::bigint::oid",
                high & 0xFFFFFFFF,
                low & 0xFFFFFFFF,
            )
            assert shared == 1
            assert await cycle() is True
            with anyio.fail_after(5):
                await heard.wait()
            await driver.unwatch(name)
            assert await cycle() is False
    finally:
        await conn.close()


async def test_live_ceiling_copy_stays_below_the_durable_ceiling(
    pg_server: PgServer, admin: asyncpg.Connection, name: str
) -> None:
    """The fast path hands out tokens up to the live row's copy of the ceiling: that copy
    must never exceed the ceiling on disk. A missing or zero copy (an older version's
    row, or a table from before the column) falls back to the full bump."""
    db = f"old_{uuid.uuid4().hex[:8]}"
    await admin.execute(f"CREATE DATABASE {db} OWNER locker")
    url = pg_server.url().replace("/asynclock", f"/{db}")
    try:
        old = await asyncpg.connect(url)
        try:  # the schema and rows of the previous version (no ceiling copy)
            await old.execute(
                "CREATE TABLE asynclock_token (name bytea PRIMARY KEY, ceiling bigint NOT NULL);"
                "CREATE UNLOGGED TABLE asynclock_token_live"
                " (name bytea PRIMARY KEY, token bigint NOT NULL)"
            )
            await old.execute("INSERT INTO asynclock_token VALUES ($1, 1499)", name.encode())
            await old.execute("INSERT INTO asynclock_token_live VALUES ($1, 600)", name.encode())
        finally:
            await old.close()
        tokens = []
        async with asynclock.connect(url) as backend:
            driver = backend.driver
            assert isinstance(driver, PostgresDriver)
            for _ in range(TOKEN_RESERVE + 10):
                async with backend.lock(name, ttl=5.0, blocking=False) as lease:
                    tokens.append(lease.token)
                check = await driver._raw_fetchval(
                    "SELECT (l.token <= l.ceiling AND l.ceiling <= d.ceiling)"
                    " FROM asynclock_token_live l JOIN asynclock_token d USING (name)"
                    " WHERE name = $1",
                    name.encode(),
                )
                assert check, tokens[-1]
        assert tokens == list(range(601, 601 + TOKEN_RESERVE + 10))
        conn = await asyncpg.connect(url)
        try:  # one reservation when 1499 ran out, none while the old ceiling covered
            assert await conn.fetchval(
                "SELECT ceiling FROM asynclock_token WHERE name = $1", name.encode()
            ) == (1500 + TOKEN_RESERVE - 1)
        finally:
            await conn.close()
    finally:
        await admin.execute(f"DROP DATABASE {db} WITH (FORCE)")


async def test_idle_session_timeout_tracks_the_longest_ttl(pg_server: PgServer, name: str) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        driver = backend.driver
        assert isinstance(driver, PostgresDriver)
        async with backend.lock(name, ttl=2.5), backend.lock(name + ":b", ttl=4.0):
            assert await driver._raw_fetchval("SHOW idle_session_timeout") == "4s"


async def test_same_backend_never_grants_one_name_twice(pg_server: PgServer, name: str) -> None:
    """Advisory locks are re-entrant per session; the driver must not be."""
    async with asynclock.connect(pg_server.url()) as backend:
        async with backend.lock(name, ttl=5.0):
            with pytest.raises(asynclock.LockHeld):
                async with backend.lock(name, ttl=5.0, blocking=False):
                    pass
        async with backend.lock(name, ttl=5.0, blocking=False):
            pass


# -- poolers ------------------------------------------------------------------------------


async def test_transaction_pooler_is_refused_for_session_locks(pgbouncer: PgBouncer) -> None:
    with pytest.raises(PoolerDetected) as info:
        async with asynclock.connect(pgbouncer.url("transaction")):
            pass
    message = str(info.value)
    assert "transaction" in message and "?mode=lease" in message
    assert PASSWORD not in message
    assert isinstance(info.value, asynclock.BackendUnavailable)


async def _exclusive_renewed_and_handed_on(url: str, name: str) -> asynclock.Backend:
    """Through a pooler: a second client is refused, renewals keep the lease, validate()
    sees it from the other client, the next holder gets a larger token. Returns one backend
    (closed) for further checks."""
    async with asynclock.connect(url) as a, asynclock.connect(url) as b:
        async with a.lock(name, ttl=0.6) as first:
            with pytest.raises(asynclock.LockHeld):
                async with b.lock(name, ttl=1.0, blocking=False):
                    pass
            await a._renewal_round()
            await a._renewal_round()
            assert not first.lost and a.stats().renewals >= 1
            assert await b.validate(name, first.token)
        async with b.lock(name, ttl=1.0, timeout=5) as second:
            assert second.token > first.token
    return a


async def test_lease_mode_works_through_a_transaction_pooler(
    pgbouncer: PgBouncer, name: str
) -> None:
    url = pgbouncer.url("transaction", query="?mode=lease")
    backend = await _exclusive_renewed_and_handed_on(url, name)
    assert isinstance(backend.driver, PostgresDriver) and backend.driver._pooled


async def test_session_mode_works_through_a_session_pooler(pgbouncer: PgBouncer, name: str) -> None:
    backend = await _exclusive_renewed_and_handed_on(pgbouncer.url("session"), name)
    assert isinstance(backend.driver, PostgresDriver) and not backend.driver._pooled


# -- scale ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_thousand_names_one_round_trip_per_renewal(
    pg_server: PgServer, mode: str, name: str
) -> None:
    count = 1000
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        all_held = anyio.Event()
        done = anyio.Event()
        held = 0

        async def hold(i: int) -> None:
            nonlocal held
            async with backend.lock(f"{name}:{i}", ttl=3.0):
                held += 1
                if held == count:
                    all_held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(hold, i)
            with anyio.fail_after(30):
                await all_held.wait()
                trips = backend.stats().renewal_round_trips
                while backend.stats().renewals < count:
                    await backend._renewal_round()
            done.set()
        stats = backend.stats()
        assert stats.losses == 0 and stats.acquired == count
        assert stats.renewal_round_trips - trips <= 3  # batched: not one per lease


# -- errors -------------------------------------------------------------------------------


async def test_bad_urls_give_clear_errors_without_the_password(pg_server: PgServer) -> None:
    secret = "s3cret-Pa55word"
    with pytest.raises(ValueError, match="port") as bad_port:
        asynclock.connect(f"postgresql://locker:{secret}@127.0.0.1:notaport/asynclock")
    assert secret not in str(bad_port.value)
    with pytest.raises(ValueError, match="mode"):
        asynclock.connect(pg_server.url() + "?mode=nope")
    cases = {
        "authentication": pg_server.url(password=secret),
        "does not exist": pg_server.url(db="no_such_db"),
        "cannot connect": f"postgresql://locker:{secret}@127.0.0.1:1/asynclock?connect_timeout=2",
    }
    for expected, url in cases.items():
        with pytest.raises(asynclock.BackendUnavailable) as info:
            async with asynclock.connect(url):
                pass
        text = f"{info.value} {info.value!r} {info.value.__cause__!r}"
        assert expected in str(info.value), str(info.value)
        assert secret not in text and PASSWORD not in text


@pytest.mark.parametrize("mode", MODES)
async def test_sql_injection_in_names_is_inert(
    pg_server: PgServer, admin: asyncpg.Connection, mode: str
) -> None:
    evil = [
        "x'); DROP TABLE asynclock_token; --",
        "x'; DELETE FROM asynclock_lease; --",
        '"; SELECT pg_terminate_backend(pg_backend_pid()); --',
        "$1",
        "\\x00\\",
        "nul\x00byte",
        "%s%s%n",
    ]
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        tokens = {}
        for n in evil:
            async with backend.lock(n, ttl=5.0, blocking=False) as lease:
                assert await backend.validate(n, lease.token)
                tokens[n] = lease.token
        for n in evil:
            async with backend.lock(n, ttl=5.0, blocking=False) as lease:
                assert lease.token > tokens[n]
    table = "asynclock_token" if mode == "session" else "asynclock_lease"
    assert await admin.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
    if mode == "session":
        rows = await admin.fetch(
            "SELECT name FROM asynclock_token WHERE name = ANY($1::bytea[])",
            [n.encode() for n in evil],
        )
        assert {bytes(r["name"]).decode() for r in rows} == set(evil)


async def test_concurrent_first_use_creates_the_schema_once(
    pg_server: PgServer, admin: asyncpg.Connection
) -> None:
    db = f"fresh_{uuid.uuid4().hex[:8]}"
    await admin.execute(f"CREATE DATABASE {db} OWNER locker")
    try:
        async with anyio.create_task_group() as tg:
            for mode in MODES * 4:

                async def use(mode: str = mode) -> None:
                    async with asynclock.connect(
                        url_for(pg_server, mode).replace("/asynclock", f"/{db}")
                    ) as backend:
                        async with backend.lock("x", ttl=5.0):
                            pass

                tg.start_soon(use)
    finally:
        await admin.execute(f"DROP DATABASE {db} WITH (FORCE)")


# -- transaction locks and the fence --------------------------------------------------------


async def test_xact_lock_excludes_session_locks_and_shares_the_counter(
    pg_server: PgServer, name: str
) -> None:
    conn = await asyncpg.connect(pg_server.url())
    try:
        await ensure_schema(conn)
        with pytest.raises(RuntimeError, match="transaction"):
            await xact_lock(conn, name)
        async with asynclock.connect(pg_server.url()) as backend:
            async with backend.lock(name, ttl=5.0) as session_lease:
                async with conn.transaction():
                    with pytest.raises(asynclock.LockHeld):
                        await xact_lock(conn, name, wait=False)
            async with conn.transaction():
                token = await xact_lock(conn, name)
                assert token > session_lease.token
                with pytest.raises(asynclock.LockHeld):
                    async with backend.lock(name, ttl=5.0, blocking=False):
                        pass
            # Committed: released with the transaction.
            async with backend.lock(name, ttl=5.0, blocking=False) as after:
                assert after.token > token
    finally:
        await conn.close()


async def test_sql_fence_on_asyncpg_rejects_stale_writes(pg_server: PgServer, name: str) -> None:
    conn = await asyncpg.connect(pg_server.url())
    fence = SQLFence()
    try:
        await fence.create_asyncpg(conn)
        await conn.execute("CREATE TABLE IF NOT EXISTS fenced_ledger (k text, token bigint)")
        async with asynclock.connect(pg_server.url()) as backend:
            old = await backend.acquire(name, ttl=5.0)
            await old.release()
            async with backend.lock(name, ttl=5.0) as new:
                async with conn.transaction():
                    await fence.check_asyncpg(conn, name, new.token)
                    await conn.execute("INSERT INTO fenced_ledger VALUES ($1, $2)", name, new.token)
                async with conn.transaction():  # the same holder again: equal token passes
                    await fence.check_asyncpg(conn, name, new.token)
        with pytest.raises(asynclock.StaleToken) as info:
            async with conn.transaction():
                await fence.check_asyncpg(conn, name, old.token)
                await conn.execute("INSERT INTO fenced_ledger VALUES ($1, $2)", name, old.token)
        assert info.value.current == new.token
        rows = await conn.fetch("SELECT token FROM fenced_ledger WHERE k = $1", name)
        assert [r["token"] for r in rows] == [new.token]
        assert await conn.fetchval("SELECT token FROM asynclock_fence WHERE key = $1", name) == (
            new.token
        )
    finally:
        await conn.close()


def test_example_postgres_fenced_write(pg_server: PgServer) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "postgres_fenced_write.py"), pg_server.url()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "late write rejected" in done.stdout
    assert done.stdout.strip().endswith("invoice total: 200")
