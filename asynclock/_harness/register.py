"""The drill's fenced resource: one integer register in a real store.

A drill worker reads the register and writes register + 1, both with its lease's token.
With the fence on, the *read* raises the store's high-water mark to the token too (it runs
the fence check), so once a newer holder has read, an older holder's late write is
rejected (StaleToken) even though it was computed from a value read before. Without the
fence, reads and writes are plain: a late write lands, and the increments made in between
are lost — what the drill's ``--no-fence`` run shows.

Stores, by the spec string the drill passes to its workers:

* ``sqlite:/path/register.db`` — a row guarded by :class:`~asynclock.fence.SQLFence`;
* ``redis://host:port/db#key`` — a key guarded by :class:`~asynclock.fence.RedisFence`;
* ``postgresql://...#key`` — a row guarded by ``SQLFence`` on asyncpg.
"""

from __future__ import annotations

import secrets
import sqlite3
from typing import Any, Protocol

import anyio

from ..fence import RedisFence, SQLFence

# The register, and a log row per accepted write in the same transaction: the store's own
# count of accepted increments (a worker killed mid-write may never report its write).
SQLITE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS asynclock_drill_register (key TEXT PRIMARY KEY, value INTEGER)",
    "CREATE TABLE IF NOT EXISTS asynclock_drill_log (key TEXT NOT NULL, token INTEGER)",
)
PG_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS asynclock_drill_register (key TEXT PRIMARY KEY, value BIGINT)",
    "CREATE TABLE IF NOT EXISTS asynclock_drill_log (key TEXT NOT NULL, token BIGINT)",
)


class Register(Protocol):
    async def setup(self) -> None: ...

    async def read(self, token: int | None) -> int:
        """The value; with a token, first raise the fence to it (StaleToken if stale)."""
        ...

    async def write(self, token: int | None, value: int) -> bool:
        """Write ``value``; with a token, through the fence. True if accepted."""
        ...

    async def applied(self) -> int:
        """How many writes the store accepted (its own log)."""
        ...

    async def aclose(self) -> None: ...


class SqliteRegister:
    def __init__(self, path: str, key: str) -> None:
        self.path, self.key = path, key
        self.fence = SQLFence()

    def _conn(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, isolation_level=None, timeout=30)

    def _setup(self) -> None:
        conn = self._conn()
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            for statement in SQLITE_SCHEMA:
                conn.execute(statement)
            self.fence.create_sqlite(conn)
            conn.execute(
                "INSERT OR IGNORE INTO asynclock_drill_register (key, value) VALUES (?, 0)",
                (self.key,),
            )
        finally:
            conn.close()

    def _read(self, token: int | None) -> int:
        conn = self._conn()
        try:
            sql = "SELECT value FROM asynclock_drill_register WHERE key = ?"
            if token is None:
                return int(conn.execute(sql, (self.key,)).fetchone()[0])
            with self.fence.sqlite_transaction(conn, self.key, token):
                return int(conn.execute(sql, (self.key,)).fetchone()[0])
        finally:
            conn.close()

    def _write(self, token: int | None, value: int) -> bool:
        from .. import StaleToken

        conn = self._conn()
        sql = "UPDATE asynclock_drill_register SET value = ? WHERE key = ?"
        log = "INSERT INTO asynclock_drill_log (key, token) VALUES (?, ?)"
        try:
            if token is None:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(sql, (value, self.key))
                conn.execute(log, (self.key, token))
                conn.execute("COMMIT")
                return True
            with self.fence.sqlite_transaction(conn, self.key, token):
                conn.execute(sql, (value, self.key))
                conn.execute(log, (self.key, token))
            return True
        except StaleToken:
            return False
        finally:
            conn.close()

    async def setup(self) -> None:
        await anyio.to_thread.run_sync(self._setup)

    async def read(self, token: int | None) -> int:
        return await anyio.to_thread.run_sync(self._read, token)

    async def write(self, token: int | None, value: int) -> bool:
        return await anyio.to_thread.run_sync(self._write, token, value)

    def _applied(self) -> int:
        conn = self._conn()
        try:
            sql = "SELECT count(*) FROM asynclock_drill_log WHERE key = ?"
            return int(conn.execute(sql, (self.key,)).fetchone()[0])
        finally:
            conn.close()

    async def applied(self) -> int:
        return await anyio.to_thread.run_sync(self._applied)

    async def aclose(self) -> None:
        pass


class RedisRegister:
    def __init__(self, url: str, key: str) -> None:
        import redis.asyncio

        self.key = key
        self.client: Any = redis.asyncio.Redis.from_url(url, socket_timeout=30)
        self.fence = RedisFence()

    async def setup(self) -> None:
        await self.client.hsetnx(self.key, "value", 0)

    async def read(self, token: int | None) -> int:
        if token is not None:
            await self.fence.check(self.client, self.key, token)
        return int(await self.client.hget(self.key, "value") or 0)

    async def write(self, token: int | None, value: int) -> bool:
        from .. import StaleToken

        # A hash: the value, and one log field per accepted write (same atomic HSET).
        fields = {"value": value, f"log:{secrets.token_hex(8)}": token or 0}
        if token is None:
            await self.client.hset(self.key, mapping=fields)
            return True
        try:
            await self.fence.hset(self.client, self.key, fields, token)
        except StaleToken:
            return False
        return True

    async def applied(self) -> int:
        return int(await self.client.hlen(self.key)) - 1

    async def aclose(self) -> None:
        await self.client.aclose()


class PostgresRegister:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.fence = SQLFence()
        self.conn: Any = None

    async def _connect(self) -> Any:
        if self.conn is None:
            import asyncpg  # type: ignore[import-untyped]

            self.conn = await asyncpg.connect(self.url, timeout=30)
        return self.conn

    async def setup(self) -> None:
        conn = await self._connect()
        for statement in PG_SCHEMA:
            await conn.execute(statement)
        await self.fence.create_asyncpg(conn)
        await conn.execute(
            "INSERT INTO asynclock_drill_register (key, value) VALUES ($1, 0) "
            "ON CONFLICT (key) DO NOTHING",
            self.key,
        )

    async def read(self, token: int | None) -> int:
        conn = await self._connect()
        sql = "SELECT value FROM asynclock_drill_register WHERE key = $1"
        if token is None:
            return int(await conn.fetchval(sql, self.key))
        async with conn.transaction():
            await self.fence.check_asyncpg(conn, self.key, token)
            return int(await conn.fetchval(sql, self.key))

    async def write(self, token: int | None, value: int) -> bool:
        from .. import StaleToken

        conn = await self._connect()
        sql = "UPDATE asynclock_drill_register SET value = $1 WHERE key = $2"
        log = "INSERT INTO asynclock_drill_log (key, token) VALUES ($1, $2)"
        if token is None:
            async with conn.transaction():
                await conn.execute(sql, value, self.key)
                await conn.execute(log, self.key, token)
            return True
        try:
            async with conn.transaction():
                await self.fence.check_asyncpg(conn, self.key, token)
                await conn.execute(sql, value, self.key)
                await conn.execute(log, self.key, token)
        except StaleToken:
            return False
        return True

    async def applied(self) -> int:
        conn = await self._connect()
        sql = "SELECT count(*) FROM asynclock_drill_log WHERE key = $1"
        return int(await conn.fetchval(sql, self.key))

    async def aclose(self) -> None:
        if self.conn is not None:
            await self.conn.close()


def open_register(spec: str) -> Register:
    """The register a spec string names (see the module's docstring)."""
    if spec.startswith("sqlite:"):
        path, _, key = spec.removeprefix("sqlite:").partition("#")
        return SqliteRegister(path, key or "drill")
    base, _, key = spec.partition("#")
    if base.startswith(("redis://", "rediss://")):
        return RedisRegister(base, key or "asynclock-drill:register")
    if base.startswith(("postgresql://", "postgres://")):
        return PostgresRegister(base.partition("?")[0], key or "drill")
    raise ValueError(
        f"no drill register for {spec!r}: sqlite:PATH, redis://... or postgresql://..."
    )
