"""The SQL fence: a high-water-mark table and a conditional upsert in the writer's transaction."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .._core.exceptions import StaleToken
from .._core.validation import check_token

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")


class _AioSqlite(Protocol):
    async def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


class _AsyncPG(Protocol):
    async def fetchval(
        self, query: str, *args: Any, column: int = 0, timeout: Any = None
    ) -> Any: ...

    async def execute(self, query: str, *args: Any, timeout: Any = None) -> str: ...


class SQLFence:
    """High-water marks in table ``table`` (columns ``key TEXT PRIMARY KEY, token BIGINT``).

    Use one of the ``check_*`` methods *inside the transaction that does the write*; it
    raises :class:`StaleToken` if a newer token was already accepted for ``key``, so your
    transaction rolls back and nothing is written::

        fence = SQLFence()
        with fence.sqlite_transaction(conn, "invoice:42", lease.token):
            conn.execute("UPDATE invoices SET total = ? WHERE id = 42", (total,))

        async with conn.transaction():                       # asyncpg
            await fence.check_asyncpg(conn, "invoice:42", lease.token)
            await conn.execute("UPDATE invoices SET total = $1 WHERE id = 42", total)
    """

    def __init__(self, table: str = "asynclock_fence") -> None:
        if not isinstance(table, str) or not _IDENT.match(table):
            raise ValueError(
                f"fence table must be a plain SQL identifier (optionally schema.table: letters, "
                f"digits, underscore, up to 63 chars each), got {table!r}"
            )
        self.table = table
        # Create the high-water-mark table; idempotent.
        self.create_sql = (
            f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, token BIGINT NOT NULL)"
        )
        # G8: raise the mark to $token unless a newer one is already there. Equal passes.
        # Args: key, token. One row back when accepted, none when stale.
        self._sqlite_check = (
            f"INSERT INTO {table} (key, token) VALUES (?, ?) "
            f"ON CONFLICT (key) DO UPDATE SET token = excluded.token "
            f"WHERE {table}.token <= excluded.token RETURNING token"
        )
        self._pg_check = (
            f"INSERT INTO {table} AS f (key, token) VALUES ($1, $2) "
            f"ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token "
            f"WHERE f.token <= EXCLUDED.token RETURNING f.token"
        )
        self._sqlite_current = f"SELECT token FROM {table} WHERE key = ?"
        self._pg_current = f"SELECT token FROM {table} WHERE key = $1"

    def __repr__(self) -> str:
        return f"SQLFence(table={self.table!r})"

    @staticmethod
    def _args(key: object, token: object) -> tuple[str, int]:
        if not isinstance(key, str) or not key:
            raise ValueError(f"fence key must be a non-empty str, got {key!r}")
        return key, check_token(token)

    # -- sqlite3 ---------------------------------------------------------------------------

    def create_sqlite(self, conn: sqlite3.Connection) -> None:
        conn.execute(self.create_sql)

    def check_sqlite(self, conn: sqlite3.Connection, key: str, token: int) -> None:
        """Inside your open transaction: accept ``token`` for ``key`` or raise StaleToken."""
        key, token = self._args(key, token)
        if conn.execute(self._sqlite_check, (key, token)).fetchone() is None:
            row = conn.execute(self._sqlite_current, (key,)).fetchone()
            raise StaleToken(key, token, None if row is None else int(row[0]))

    @contextmanager
    def sqlite_transaction(
        self, conn: sqlite3.Connection, key: str, token: int
    ) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``, check the fence, run your writes, ``COMMIT`` (or roll back).

        ``conn`` must not be inside a transaction already (open it with
        ``isolation_level=None`` to manage transactions yourself); inside one, call
        :meth:`check_sqlite` instead.
        """
        if conn.in_transaction:
            raise ValueError(
                "sqlite_transaction() starts its own transaction, but the connection is "
                "already in one; call check_sqlite() inside your transaction instead"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            self.check_sqlite(conn, key, token)
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- aiosqlite -------------------------------------------------------------------------

    async def check_aiosqlite(self, conn: _AioSqlite, key: str, token: int) -> None:
        """The same check on an ``aiosqlite`` connection, inside your transaction."""
        key, token = self._args(key, token)
        cursor = await conn.execute(self._sqlite_check, (key, token))
        if await cursor.fetchone() is None:
            cursor = await conn.execute(self._sqlite_current, (key,))
            row = await cursor.fetchone()
            raise StaleToken(key, token, None if row is None else int(row[0]))

    # -- asyncpg ---------------------------------------------------------------------------

    async def create_asyncpg(self, conn: _AsyncPG) -> None:
        await conn.execute(self.create_sql)

    async def check_asyncpg(self, conn: _AsyncPG, key: str, token: int) -> None:
        """Inside ``async with conn.transaction():`` — accept ``token`` or raise StaleToken."""
        key, token = self._args(key, token)
        if await conn.fetchval(self._pg_check, key, token) is None:
            current = await conn.fetchval(self._pg_current, key)
            raise StaleToken(key, token, None if current is None else int(current))
