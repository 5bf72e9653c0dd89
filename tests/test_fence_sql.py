"""SQLFence on sqlite3 and aiosqlite (asyncpg: tests/backends/test_postgres.py): the mark
only moves up, an equal token passes, a stale one raises and writes nothing (G8)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import aiosqlite
import pytest

import asynclock
from asynclock.fence import SQLFence

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
    with pytest.raises(ValueError, match="non-empty str"):
        fence.check_sqlite(conn, "", 1)
    with pytest.raises(ValueError, match="positive 64-bit"):
        fence.check_sqlite(conn, "k", 0)
    with pytest.raises(TypeError, match="must be an int"):
        fence.check_sqlite(conn, "k", "1")  # type: ignore[arg-type]
