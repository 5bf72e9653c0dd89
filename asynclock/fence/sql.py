"""The SQL fence: a high-water-mark table and a conditional upsert in the writer's transaction."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol, TypeVar

import anyio

from .._core.exceptions import StaleToken
from .._core.observer import stale_token
from .._core.validation import check_token, check_ttl

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$")


class _AioSqlite(Protocol):
    @property
    def in_transaction(self) -> bool: ...

    @property
    def isolation_level(self) -> str | None: ...

    async def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


class _AsyncPG(Protocol):
    async def fetchval(
        self, query: str, *args: Any, column: int = 0, timeout: Any = None
    ) -> Any: ...

    async def execute(self, query: str, *args: Any, timeout: Any = None) -> str: ...

    def is_in_transaction(self) -> bool: ...

    def transaction(self) -> _AsyncPGTransaction: ...


class _AsyncPGTransaction(Protocol):
    async def start(self) -> None: ...

    async def commit(self) -> None: ...

    async def rollback(self) -> None: ...


_Conn = TypeVar("_Conn", bound=_AsyncPG)

#: The longest fence key, in UTF-8 bytes: the bound on lock names, so a lock name (the
#: usual fence key) always fits, far below PostgreSQL's btree entry limit (~2.7 kB).
MAX_KEY_BYTES = 512


def check_key(key: object) -> str:
    """A fence key every driver stores alike: a non-empty str of at most
    :data:`MAX_KEY_BYTES` UTF-8 bytes, with no NUL (PostgreSQL text cannot hold one, so
    sqlite would accept keys that asyncpg refuses) and no lone surrogate (not UTF-8)."""
    if not isinstance(key, str):
        raise TypeError(f"fence key must be a str, not {type(key).__name__}")
    if not key:
        raise ValueError(
            f"fence key must be a non-empty str (1 to {MAX_KEY_BYTES} UTF-8 bytes), got ''"
        )
    nul = key.find("\x00")
    if nul >= 0:
        raise ValueError(
            f"fence key {key[:40]!r} has a NUL character at index {nul}; PostgreSQL text "
            "cannot store NUL, so no SQL fence accepts it (use another separator)"
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"fence key {key[:40]!r} has a lone surrogate {key[exc.start]!r} at index "
            f"{exc.start}; fence keys must be text that encodes as UTF-8"
        ) from None
    if size > MAX_KEY_BYTES:
        raise ValueError(
            f"fence key is {size} UTF-8 bytes; at most {MAX_KEY_BYTES} are allowed "
            "(the bound on lock names)"
        )
    return key


def _in_sqlite_transaction(conn: sqlite3.Connection | _AioSqlite) -> bool:
    """Will the check's INSERT run inside a transaction that the caller commits?

    True inside an open transaction, and under sqlite3's legacy transaction control with
    an ``isolation_level`` (the default), which opens one before an INSERT. False in
    autocommit mode (``isolation_level=None`` or ``autocommit=True``) outside ``BEGIN``,
    where the mark would commit on its own, before (and without) the caller's write.
    """
    if conn.in_transaction:
        return True
    legacy = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)  # Python >= 3.12
    if getattr(conn, "autocommit", legacy) != legacy:
        return False  # autocommit=True (False would have a transaction open)
    return conn.isolation_level is not None


def _no_sqlite_transaction(call: str) -> RuntimeError:
    return RuntimeError(
        f"{call} must run inside the transaction that does the write, but no transaction "
        "is open (the connection is in autocommit mode): the mark would commit on its own, "
        "not atomically with your write. Open one first (execute 'BEGIN IMMEDIATE', commit "
        "after your writes) or use `with fence.sqlite_transaction(conn, key, token):`"
    )


class SQLFence:
    """High-water marks in table ``table`` (columns ``key TEXT PRIMARY KEY, token BIGINT``).

    Use one of the ``check_*`` methods *inside the transaction that does the write*; it
    raises :class:`StaleToken` if a newer token was already accepted for ``key``, so your
    transaction rolls back and nothing is written. Outside a transaction (autocommit) a
    check raises :class:`RuntimeError` and writes nothing: the mark would commit on its
    own, apart from the write. Keys are non-empty text of at most 512 UTF-8 bytes with
    no NUL character; anything else raises TypeError/ValueError before any SQL::

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
        return check_key(key), check_token(token)

    # -- sqlite3 ---------------------------------------------------------------------------

    def create_sqlite(self, conn: sqlite3.Connection) -> None:
        conn.execute(self.create_sql)

    def check_sqlite(self, conn: sqlite3.Connection, key: str, token: int) -> None:
        """Inside your open transaction: accept ``token`` for ``key`` or raise StaleToken.

        Raises :class:`RuntimeError` (nothing written) when the connection has no
        transaction open and would not open one for the check (autocommit mode)."""
        key, token = self._args(key, token)
        if not _in_sqlite_transaction(conn):
            raise _no_sqlite_transaction("check_sqlite()")
        self._sqlite_check_in_transaction(conn, key, token)

    def _sqlite_check_in_transaction(self, conn: sqlite3.Connection, key: str, token: int) -> None:
        if conn.execute(self._sqlite_check, (key, token)).fetchone() is None:
            row = conn.execute(self._sqlite_current, (key,)).fetchone()
            stale_token("sql")
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
        key, token = self._args(key, token)
        if conn.in_transaction:
            raise ValueError(
                "sqlite_transaction() starts its own transaction, but the connection is "
                "already in one; call check_sqlite() inside your transaction instead"
            )
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._sqlite_check_in_transaction(conn, key, token)
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- aiosqlite -------------------------------------------------------------------------

    async def check_aiosqlite(self, conn: _AioSqlite, key: str, token: int) -> None:
        """The same check on an ``aiosqlite`` connection, inside your transaction
        (:class:`RuntimeError`, nothing written, outside one in autocommit mode)."""
        key, token = self._args(key, token)
        if not _in_sqlite_transaction(conn):
            raise _no_sqlite_transaction("check_aiosqlite()")
        cursor = await conn.execute(self._sqlite_check, (key, token))
        if await cursor.fetchone() is None:
            cursor = await conn.execute(self._sqlite_current, (key,))
            row = await cursor.fetchone()
            stale_token("sql")
            raise StaleToken(key, token, None if row is None else int(row[0]))

    # -- asyncpg ---------------------------------------------------------------------------

    async def create_asyncpg(self, conn: _AsyncPG) -> None:
        await conn.execute(self.create_sql)

    async def check_asyncpg(self, conn: _AsyncPG, key: str, token: int) -> None:
        """Inside ``async with conn.transaction():`` — accept ``token`` or raise StaleToken.

        Raises :class:`RuntimeError` (nothing written) outside a transaction, where the
        mark would autocommit on its own, not atomically with your write."""
        key, token = self._args(key, token)
        if not _asyncpg_connection(conn, "check_asyncpg()").is_in_transaction():
            raise RuntimeError(
                "check_asyncpg() must run inside the transaction that does the write, but "
                "no transaction is open on this connection: the mark would autocommit on its "
                "own, not atomically with your write. Wrap the check and your writes in "
                "`async with conn.transaction():`"
            )
        await self._pg_check_in_transaction(conn, key, token)

    async def _pg_check_in_transaction(self, conn: _AsyncPG, key: str, token: int) -> None:
        if await conn.fetchval(self._pg_check, key, token) is None:
            current = await conn.fetchval(self._pg_current, key)
            stale_token("sql")
            raise StaleToken(key, token, None if current is None else int(current))

    @asynccontextmanager
    async def asyncpg_transaction(
        self, conn: _Conn, key: str, token: int, *, rollback_timeout: float = 5.0
    ) -> AsyncIterator[_Conn]:
        """Open a transaction on ``conn``, check the fence, run your writes, commit.

        On any exception, a lost lease's cancellation included, the transaction is rolled
        back *shielded* (for at most ``rollback_timeout`` seconds), so the connection
        comes back usable. Inside a lost lease's ``async with`` every await is cancelled,
        the rollback of a plain ``async with conn.transaction():`` too, which leaves a
        connection of your own (not a pool's: a pool resets it on release) in an aborted
        transaction. ``conn`` must not be in a transaction already; inside one, call
        :meth:`check_asyncpg` instead.
        """
        key, token = self._args(key, token)
        bound = check_ttl(rollback_timeout, what="rollback_timeout")
        if _asyncpg_connection(conn, "asyncpg_transaction()").is_in_transaction():
            raise ValueError(
                "asyncpg_transaction() starts its own transaction, but the connection is "
                "already in one; call check_asyncpg() inside your transaction instead"
            )
        transaction = conn.transaction()
        await transaction.start()
        try:
            await self._pg_check_in_transaction(conn, key, token)
            yield conn
            await transaction.commit()
        except BaseException:
            if conn.is_in_transaction():
                # What the body raised (a lost lease's cancellation too) is what propagates;
                # a rollback that fails as well leaves the connection for asyncpg to report.
                with anyio.move_on_after(bound, shield=True), contextlib.suppress(Exception):
                    await transaction.rollback()
            raise


def _asyncpg_connection(conn: _AsyncPG, call: str) -> _AsyncPG:
    """``conn`` if it is one asyncpg connection (a pool is refused: it runs each statement
    on whichever connection is free)."""
    if getattr(conn, "is_in_transaction", None) is None:
        raise TypeError(
            f"{call} needs an asyncpg connection, not {type(conn).__name__} (a pool runs "
            "each statement on whichever connection is free): "
            "`async with pool.acquire() as conn:`"
        )
    return conn
