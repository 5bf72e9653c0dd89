"""Keys, channels and the token source every mode and :func:`xact_lock` share (epochs,
the range row, see "Tokens" in docs/backends/postgres.md)."""

from __future__ import annotations

import functools
import hashlib

import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.exceptions import BackendUnavailable, LockHeld
from ..._core.validation import check_name
from .sql import (
    _SCHEMA_KEY,
    SCHEMA_LEASE,
    SCHEMA_TOKENS,
    SQL_TOKEN_EPOCH,
    SQL_X_LOCK,
    SQL_X_TOKEN,
    SQL_X_TRY,
)
from .xact import transaction

_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def lock_key(name: str) -> int:
    """The advisory-lock key of ``name``: the first 8 bytes of SHA-256 of its UTF-8
    encoding, read as a big-endian *signed* 64-bit integer (PostgreSQL's ``bigint``).

    In SQL: ``('x' || left(encode(sha256(convert_to(name, 'UTF8')), 'hex'), 16))::bit(64)::bigint``
    (:data:`KEY_SQL`). In ``pg_locks`` the key shows as ``classid`` (high 32 bits) and
    ``objid`` (low 32 bits) with ``objsubid = 1``.
    """
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@functools.lru_cache(maxsize=4096)
def notify_channel(name: str) -> str:
    """The LISTEN/NOTIFY channel that announces releases of ``name``."""
    return f"asynclock_{lock_key(name) & _MASK64:016x}"


@functools.lru_cache(maxsize=4096)
def waiter_key(name: str) -> tuple[int, int]:
    """The advisory-lock key a backend waiting for ``name`` holds *shared* on its LISTEN
    connection, so that a release NOTIFYs only when someone may be waiting: the two-int4
    form of :func:`lock_key` (its high and low 32 bits, signed). In ``pg_locks`` it has the
    same ``classid``/``objid`` as the lock and ``objsubid = 2``."""
    key = lock_key(name)
    low = key & 0xFFFFFFFF
    return key >> 32, low - (1 << 32) if low >= 1 << 31 else low


def _name_bytes(name: str) -> bytes:
    # Names are stored as their UTF-8 bytes (bytea): any str the core accepts, NUL included.
    return name.encode("utf-8", "surrogatepass")


async def ensure_schema(conn: asyncpg.Connection, *, mode: str = "session") -> None:
    """Create the tables of ``mode`` ("session" or "lease") if missing: the token source
    that every mode and :func:`xact_lock` share, and for mode lease the lease table.

    Idempotent and safe when many processes start at once: creation runs in one
    transaction behind a transaction advisory lock. When the tables exist this is one
    read-only query (no CREATE privilege needed).
    """
    tables = ["asynclock_token_seq", "asynclock_token_epoch", "asynclock_token_range"]
    schema = SCHEMA_TOKENS.format(
        # Unlogged sequences need PostgreSQL 15; a logged one is as safe, only slower
        # (crash recovery empties the range row either way, see "Tokens").
        persistence="UNLOGGED" if conn.get_server_version().major >= 15 else ""
    )
    if mode == "lease":
        tables.append("asynclock_lease")
        schema += ";" + SCHEMA_LEASE
    if await conn.fetchval(
        "SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest($1::text[]) t", tables
    ):
        return
    async with transaction(conn):  # ended even if cancelled (see xact.py)
        await conn.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_KEY})")
        await conn.execute(schema)


async def _new_epoch(conn: asyncpg.Connection) -> None:
    """Start a token epoch, or raise the range's limit (SQL_TOKEN_EPOCH); after it, the
    next token statement finds a usable range unless it is used up again at once."""
    await conn.fetchrow(SQL_TOKEN_EPOCH)


#: How often one acquisition starts an epoch before giving up (normally once at most).
_EPOCH_TRIES = 5


def _no_range(where: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"{where}: the token range (table asynclock_token_range) stays missing or used up "
        f"after {_EPOCH_TRIES} new epochs; is something deleting it?"
    )


async def xact_lock(conn: asyncpg.Connection, name: str, *, wait: bool = True) -> int:
    """Take ``name``'s lock for the rest of the caller's transaction; return its token.

    ``pg_advisory_xact_lock`` on :func:`lock_key` (the same key as session mode, so the
    two exclude each other) and a token from the source every mode shares, in one
    statement inside your transaction. The lock is released at commit or rollback; the
    token is above every earlier token of the name, whichever mode took it, so fence your
    writes with it. Pooler-safe.

    ``wait=False`` raises :class:`~asynclock.LockHeld` instead of waiting. Call
    :func:`ensure_schema` once beforehand (or let a backend create it)::

        async with conn.transaction():
            token = await xact_lock(conn, "invoice:42")
            await fence.check_asyncpg(conn, "invoice:42", token)
            ...
    """
    name = check_name(name)
    if not conn.is_in_transaction():
        raise RuntimeError(
            "xact_lock must run inside a transaction (`async with conn.transaction():`); "
            "outside one the lock would end with this statement"
        )
    key = lock_key(name)
    try:
        ok, token = await conn.fetchrow(SQL_X_LOCK if wait else SQL_X_TRY, key)
        if not ok:
            raise LockHeld(name)
        for _ in range(_EPOCH_TRIES):
            if token is not None:
                return int(token)
            # First use, or the first token since crash recovery: the new epoch commits
            # with your transaction (synchronously), see "Tokens".
            await _new_epoch(conn)
            token = await conn.fetchval(SQL_X_TOKEN, key, column=1)
    except asyncpg.exceptions.UndefinedTableError:
        raise BackendUnavailable(
            "the asynclock token tables do not exist: run `await ensure_schema(conn)` once "
            "(or open a backend on this database)"
        ) from None
    if token is None:
        raise _no_range("xact_lock")
    return int(token)
