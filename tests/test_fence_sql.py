"""SQLFence on sqlite3, aiosqlite and asyncpg (a real PostgreSQL; the stale-write story on
asyncpg is in tests/backends/test_postgres.py): the mark only moves up, an equal token
passes, a stale one raises and writes nothing (G8); a check outside a transaction and bad
keys or tokens are refused before any SQL runs, the same way on every driver."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import aiosqlite
import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock.fence import SQLFence
from tests.support.pg_servers import PgServer

pytestmark = pytest.mark.anyio


def ledger(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    SQLFence().create_sqlite(conn)
    conn.execute("CREATE TABLE IF NOT EXISTS ledger (token INTEGER)")
    return conn


def rows(conn: sqlite3.Connection) -> list[int]:
    return [r[0] for r in conn.execute("SELECT token FROM ledger ORDER BY rowid")]


def test_sqlite3_fence(tmp_path: Path) -> None:
    conn, fence = ledger(tmp_path / "r.db"), SQLFence()
    for token in (5, 5, 7):  # higher moves the mark, equal is the same holder again
        with fence.sqlite_transaction(conn, "k", token):
            conn.execute("INSERT INTO ledger VALUES (?)", (token,))
    with pytest.raises(asynclock.StaleToken) as info, fence.sqlite_transaction(conn, "k", 6):
        conn.execute("INSERT INTO ledger VALUES (6)")
    assert (info.value.token, info.value.current) == (6, 7)
    assert rows(conn) == [5, 5, 7]
    with fence.sqlite_transaction(conn, "other", 1):  # marks are per key
        conn.execute("INSERT INTO ledger VALUES (1)")
    conn.execute("BEGIN")
    with pytest.raises(ValueError, match="already in one"):
        fence.sqlite_transaction(conn, "k", 8).__enter__()
    conn.execute("ROLLBACK")


async def test_aiosqlite_fence(tmp_path: Path) -> None:
    ledger(tmp_path / "r.db").close()
    fence = SQLFence()
    async with aiosqlite.connect(tmp_path / "r.db", isolation_level=None) as conn:
        for token, accepted in ((3, True), (3, True), (2, False), (4, True)):
            await conn.execute("BEGIN IMMEDIATE")
            try:
                await fence.check_aiosqlite(conn, "k", token)
                await conn.execute("INSERT INTO ledger VALUES (?)", (token,))
                await conn.execute("COMMIT")
                assert accepted
            except asynclock.StaleToken as stale:
                await conn.execute("ROLLBACK")
                assert not accepted and stale.current == 3
    assert rows(sqlite3.connect(tmp_path / "r.db")) == [3, 3, 4]


def test_bad_fence_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain SQL identifier"):
        SQLFence("fence; DROP TABLE x")
    conn, fence = ledger(tmp_path / "r.db"), SQLFence()
    with pytest.raises(ValueError, match="non-empty"):
        fence.check_sqlite(conn, "", 1)
    with pytest.raises(ValueError, match="positive 64-bit"):
        fence.check_sqlite(conn, "k", 0)
    with pytest.raises(TypeError, match="must be an int"):
        fence.check_sqlite(conn, "k", "1")  # type: ignore[arg-type]


# -- a check outside a transaction would autocommit the mark on its own (issue 8, item 5) --


def fence_rows(conn: sqlite3.Connection) -> list[tuple[str, int]]:
    return list(conn.execute("SELECT key, token FROM asynclock_fence ORDER BY key"))


def test_sqlite3_check_outside_a_transaction_is_refused(tmp_path: Path) -> None:
    conn, fence = ledger(tmp_path / "r.db"), SQLFence()  # autocommit (isolation_level=None)
    assert not conn.in_transaction
    with pytest.raises(RuntimeError, match=r"check_sqlite\(\).*no transaction is open") as info:
        fence.check_sqlite(conn, "k", 5)
    assert "sqlite_transaction" in str(info.value) and "BEGIN" in str(info.value)
    assert fence_rows(conn) == [] and not conn.in_transaction  # nothing written, nothing begun
    conn.execute("BEGIN")  # inside a transaction it works, and commits with the write
    fence.check_sqlite(conn, "k", 5)
    conn.execute("COMMIT")
    assert fence_rows(conn) == [("k", 5)]


def test_sqlite3_check_in_an_implicit_transaction_is_accepted(tmp_path: Path) -> None:
    ledger(tmp_path / "r.db").close()
    # sqlite3's default (legacy) transaction control opens a transaction before the
    # check's INSERT, so the mark commits or rolls back with the caller's writes.
    conn, fence = sqlite3.connect(tmp_path / "r.db"), SQLFence()
    fence.check_sqlite(conn, "k", 5)
    assert conn.in_transaction
    conn.execute("INSERT INTO ledger VALUES (5)")
    conn.rollback()
    assert fence_rows(conn) == [] and rows(conn) == []
    fence.check_sqlite(conn, "k", 6)
    conn.commit()
    assert fence_rows(conn) == [("k", 6)]


async def test_aiosqlite_check_outside_a_transaction_is_refused(tmp_path: Path) -> None:
    ledger(tmp_path / "r.db").close()
    fence = SQLFence()
    async with aiosqlite.connect(tmp_path / "r.db", isolation_level=None) as conn:
        with pytest.raises(RuntimeError, match=r"check_aiosqlite\(\).*no transaction is open"):
            await fence.check_aiosqlite(conn, "k", 5)
        assert not conn.in_transaction
    assert fence_rows(sqlite3.connect(tmp_path / "r.db")) == []


async def test_asyncpg_check_outside_a_transaction_is_refused(pg_server: PgServer) -> None:
    fence = SQLFence("fence_no_tx")
    conn = await asyncpg.connect(pg_server.url())
    try:
        await fence.create_asyncpg(conn)
        with pytest.raises(
            RuntimeError, match=r"check_asyncpg\(\).*no transaction is open"
        ) as info:
            await fence.check_asyncpg(conn, "k", 5)
        assert "conn.transaction()" in str(info.value)
        assert await conn.fetch("SELECT key FROM fence_no_tx") == []  # nothing written
        async with conn.transaction():
            await fence.check_asyncpg(conn, "k", 5)
        assert await conn.fetchval("SELECT token FROM fence_no_tx WHERE key = 'k'") == 5
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(pg_server.url(), min_size=1, max_size=2)
    try:  # a pool would run the check and the write on different connections
        with pytest.raises(TypeError, match=r"not Pool.*pool.acquire\(\)"):
            await fence.check_asyncpg(pool, "k", 6)
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT token FROM fence_no_tx WHERE key = 'k'") == 5
            async with conn.transaction():  # a pool's connection proxy works
                await fence.check_asyncpg(conn, "k", 6)
    finally:
        await pool.close()


async def test_asyncpg_transaction_commits_checked_writes_and_rolls_back_the_rest(
    pg_server: PgServer,
) -> None:
    fence = SQLFence("fence_tx")
    conn = await asyncpg.connect(pg_server.url())
    try:
        await fence.create_asyncpg(conn)
        await conn.execute("CREATE TABLE fence_tx_rows (v int)")
        async with fence.asyncpg_transaction(conn, "k", 5) as same:
            assert same is conn and conn.is_in_transaction()
            await conn.execute("INSERT INTO fence_tx_rows VALUES (5)")
        assert not conn.is_in_transaction()
        with pytest.raises(asynclock.StaleToken) as stale:
            async with fence.asyncpg_transaction(conn, "k", 4):
                pytest.fail("the body must not run for a stale token")
        assert (stale.value.token, stale.value.current) == (4, 5)
        with pytest.raises(ZeroDivisionError):
            async with fence.asyncpg_transaction(conn, "k", 6):
                await conn.execute("INSERT INTO fence_tx_rows VALUES (6)")
                raise ZeroDivisionError
        assert not conn.is_in_transaction()
        assert [r["v"] for r in await conn.fetch("SELECT v FROM fence_tx_rows")] == [5]
        assert await conn.fetchval("SELECT token FROM fence_tx WHERE key = 'k'") == 5
        async with conn.transaction():
            with pytest.raises(ValueError, match="already in one; call check_asyncpg"):
                async with fence.asyncpg_transaction(conn, "k", 7):
                    pass
        bad_timeouts: list[tuple[object, type[Exception], str]] = [
            (0, ValueError, "finite number of seconds > 0"),
            (-1.0, ValueError, "finite number of seconds > 0"),
            (float("inf"), ValueError, "finite number of seconds > 0"),
            (float("nan"), ValueError, "not NaN"),
            ("5", TypeError, "not str"),
            (True, TypeError, "not bool"),
        ]
        for bad, error, message in bad_timeouts:
            with pytest.raises(error, match=f"rollback_timeout must be a .*{message}"):
                async with fence.asyncpg_transaction(conn, "k", 7, rollback_timeout=bad):  # type: ignore[arg-type]
                    pass
        assert not conn.is_in_transaction()
    finally:
        await conn.close()
    pool = await asyncpg.create_pool(pg_server.url(), min_size=1, max_size=1)
    try:
        with pytest.raises(TypeError, match=r"asyncpg_transaction\(\) needs.*not Pool"):
            async with fence.asyncpg_transaction(pool, "k", 7):
                pass
    finally:
        await pool.close()


async def test_asyncpg_transaction_rolls_back_a_lost_leases_write(pg_server: PgServer) -> None:
    """A lost lease cancels every await in its body, a plain transaction's rollback too;
    asyncpg_transaction's rollback is shielded, so the connection comes back usable."""
    fence = SQLFence("fence_lost")
    conn = await asyncpg.connect(pg_server.url())
    watcher = await asyncpg.connect(pg_server.url())
    sleeping = (
        "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active' "
        "AND query = 'SELECT pg_sleep(60)'"
    )

    async def break_once_the_statement_runs(backend: asynclock.Backend) -> None:
        # The lease is lost while the statement runs at the server. (Lost as it was being
        # sent, the cancel request asyncpg sends can reach PostgreSQL before the statement
        # does, and PostgreSQL ignores a cancel for an idle backend: the sleep then ran its
        # 60 s and the test timed out once in CI.)
        while not await watcher.fetchval(sleeping, conn.get_server_pid()):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        await backend.break_lock("k")  # lost: the body is cancelled

    try:
        await fence.create_asyncpg(conn)
        await conn.execute("CREATE TABLE fence_lost_rows (v int)")
        async with asynclock.connect("memory://") as backend:
            with pytest.raises(asynclock.LeaseLost, match="break_lock"), anyio.fail_after(20):
                async with backend.lock("k", ttl=10) as lease:
                    async with fence.asyncpg_transaction(conn, "k", lease.token):
                        await conn.execute("INSERT INTO fence_lost_rows VALUES (1)")
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(break_once_the_statement_runs, backend)
                            await conn.execute("SELECT pg_sleep(60)")  # cancelled then
                        pytest.fail("the body ran on after its lease was lost")
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM fence_lost_rows") == 0
        assert await conn.fetchval("SELECT count(*) FROM fence_lost") == 0
    finally:
        await conn.close()
        await watcher.close()


# -- every fence input checked the same way on every driver, before any SQL (item 15) -------

BAD_INPUTS: list[tuple[object, object, type[Exception], str]] = [
    (1, 1, TypeError, "fence key must be a str, not int"),
    (b"k", 1, TypeError, "fence key must be a str, not bytes"),
    ("", 1, ValueError, "fence key must be a non-empty str"),
    ("a\x00b", 1, ValueError, "NUL"),
    ("\ud800", 1, ValueError, "surrogate"),
    ("x" * 513, 1, ValueError, "at most 512"),
    ("k", 0, ValueError, "positive 64-bit"),
    ("k", -1, ValueError, "positive 64-bit"),
    ("k", 2**63, ValueError, "positive 64-bit"),
    ("k", True, TypeError, "must be an int"),
    ("k", "1", TypeError, "must be an int"),
    ("k", 1.0, TypeError, "must be an int"),
]
BAD_IDS = [f"{k!r:.12}-{t!r}" for k, t, _, _ in BAD_INPUTS]


@pytest.mark.parametrize(("key", "token", "error", "message"), BAD_INPUTS, ids=BAD_IDS)
async def test_bad_fence_input_is_refused_alike_on_every_driver(
    pg_server: PgServer,
    tmp_path: Path,
    key: object,
    token: object,
    error: type[Exception],
    message: str,
) -> None:
    fence = SQLFence("fence_bad_input")
    sync = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    fence.create_sqlite(sync)
    sync.execute("BEGIN")
    with pytest.raises(error, match=message):
        fence.check_sqlite(sync, key, token)  # type: ignore[arg-type]
    sync.execute("ROLLBACK")
    with pytest.raises(error, match=message):
        with fence.sqlite_transaction(sync, key, token):  # type: ignore[arg-type]
            pass
    assert not sync.in_transaction  # refused before BEGIN IMMEDIATE
    async with aiosqlite.connect(tmp_path / "r.db", isolation_level=None) as conn:
        await conn.execute("BEGIN")
        with pytest.raises(error, match=message):
            await fence.check_aiosqlite(conn, key, token)  # type: ignore[arg-type]
        await conn.execute("ROLLBACK")
    assert fence_rows_of(sync, "fence_bad_input") == []
    pg = await asyncpg.connect(pg_server.url())
    try:
        await fence.create_asyncpg(pg)
        async with pg.transaction():
            with pytest.raises(error, match=message):
                await fence.check_asyncpg(pg, key, token)  # type: ignore[arg-type]
            # Refused before any statement: the transaction is not aborted.
            assert await pg.fetchval("SELECT count(*) FROM fence_bad_input") == 0
    finally:
        await pg.close()


def fence_rows_of(conn: sqlite3.Connection, table: str) -> list[tuple[str, int]]:
    return list(conn.execute(f"SELECT key, token FROM {table}"))
