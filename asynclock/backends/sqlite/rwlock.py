"""Read-write locks in the SQLite file (the rules are :mod:`asynclock._core.rw_store`'s):

* ``asynclock_rw`` — one row per name: ``epoch``, the last write hold's token. Never
  deleted, so the epoch only rises (G2 for writers);
* ``asynclock_rw_hold`` — one row per live hold or intent: ``mode`` is ``r`` (a reader),
  ``w`` (the writer) or ``i`` (a waiting writer's intent), ``token`` the epoch it holds.

A grant is one write transaction (``BEGIN IMMEDIATE``): drop the name's expired rows, read
the live ones, decide, write. Renewals and releases are owner-, mode- and token-checked
single statements."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.rw_store import (
    READ,
    READERS_HOLD,
    WRITE,
    WRITER_HOLDS,
    WRITER_WAITS,
    Held,
    RWAnswer,
    RWStore,
    rw_holders,
)

if TYPE_CHECKING:
    from . import SQLiteDriver

INTENT = "i"

# Drop the name's expired rows (or rows from before a reboot). Args: name, boot, now.
SQL_RW_EXPIRE = "DELETE FROM asynclock_rw_hold WHERE name = ?1 AND (boot <> ?2 OR expires_at <= ?3)"
# The live rows of a name (after SQL_RW_EXPIRE). Args: name.
SQL_RW_LIVE = "SELECT owner, mode, expires_at FROM asynclock_rw_hold WHERE name = ?1"
# Who holds it, read-only (the live rows, not those of an earlier boot). Args: name, boot,
# now.
SQL_RW_HOLDERS = (
    "SELECT owner, mode, expires_at FROM asynclock_rw_hold "
    "WHERE name = ?1 AND boot = ?2 AND expires_at > ?3"
)
# The name's epoch (no row: 0). Args: name.
SQL_RW_EPOCH = "SELECT epoch FROM asynclock_rw WHERE name = ?1"
# The next epoch. Args: name. Returns it.
SQL_RW_BUMP = (
    "INSERT INTO asynclock_rw (name, epoch) VALUES (?1, 1) "
    "ON CONFLICT (name) DO UPDATE SET epoch = asynclock_rw.epoch + 1 RETURNING epoch"
)
# A hold or an intent (replacing the owner's intent). Args: name, owner, mode, token,
# expires_at, boot.
SQL_RW_PUT = (
    "INSERT OR REPLACE INTO asynclock_rw_hold (name, owner, mode, token, expires_at, boot) "
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
)
# Renew our live hold. Args: expires_at, name, owner, mode, token, boot, now.
SQL_RW_EXTEND = (
    "UPDATE asynclock_rw_hold SET expires_at = ?1 WHERE name = ?2 AND owner = ?3 "
    "AND mode = ?4 AND token = ?5 AND boot = ?6 AND expires_at > ?7"
)
# Free our live hold (token if known) or withdraw our intent. Args: name, owner, mode,
# token or NULL, boot, now.
SQL_RW_RELEASE = (
    "DELETE FROM asynclock_rw_hold WHERE name = ?1 AND owner = ?2 AND mode = ?3 "
    "AND (?4 IS NULL OR token = ?4) AND boot = ?5 AND expires_at > ?6"
)


class SQLiteRW(RWStore):
    """A read-write lock in the SQLite file (see the module)."""

    def __init__(self, driver: SQLiteDriver, name: str) -> None:
        super().__init__(name)
        self.driver = driver
        self.display = driver.display

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        name, boot = self.name, self.driver.boot

        def attempt(db: sqlite3.Connection) -> RWAnswer:
            now = time.monotonic()
            db.execute(SQL_RW_EXPIRE, (name, boot, now))
            live = db.execute(SQL_RW_LIVE, (name,)).fetchall()
            writer = [float(r[2]) for r in live if r[1] == WRITE]
            readers = [float(r[2]) for r in live if r[1] == READ]
            intents = [r for r in live if r[1] == INTENT]
            busy: Held | None = None
            if writer:
                busy = Held(WRITER_HOLDS, writer[0] - now)
            elif mode == READ and intents:
                return Held(WRITER_WAITS)
            elif mode == WRITE and readers:
                busy = Held(READERS_HOLD, min(readers) - now)
            if busy is not None:
                if intend:
                    db.execute(SQL_RW_PUT, (name, owner, INTENT, 0, now + ttl, boot))
                return busy
            if mode == READ:
                row = db.execute(SQL_RW_EPOCH, (name,)).fetchone()
                token = 0 if row is None else int(row[0])
            else:
                token = int(db.execute(SQL_RW_BUMP, (name,)).fetchone()[0])
            db.execute(SQL_RW_PUT, (name, owner, mode, token, now + ttl, boot))
            return token

        return await self.driver._write(attempt)

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        boot = self.driver.boot

        def renew(db: sqlite3.Connection) -> list[ExtendResult]:
            now = time.monotonic()
            out: list[ExtendResult] = []
            for ref in leases:
                args = (now + ref.ttl, self.name, ref.owner, mode, ref.token, boot, now)
                cur = db.execute(SQL_RW_EXTEND, args)
                out.append(True if cur.rowcount == 1 else Refused("the hold expired or was freed"))
            return out

        return await self.driver._write(renew)

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        args = (self.name, owner, mode, token, self.driver.boot, time.monotonic())
        cursor = await self.driver._statement(SQL_RW_RELEASE, args)
        return cursor.rowcount == 1

    async def withdraw(self, owner: str) -> None:
        args = (self.name, owner, INTENT, None, self.driver.boot, time.monotonic())
        await self.driver._statement(SQL_RW_RELEASE, args)

    async def holders(self) -> list[Holder]:
        def read(db: sqlite3.Connection) -> tuple[list[tuple[str, str, float]], int, float]:
            now = time.monotonic()
            rows = db.execute(SQL_RW_HOLDERS, (self.name, self.driver.boot, now)).fetchall()
            epoch = db.execute(SQL_RW_EPOCH, (self.name,)).fetchone()
            return rows, 0 if epoch is None else int(epoch[0]), now

        rows, epoch, now = await self.driver._write(read)  # one snapshot of both tables
        live = {m: [(str(o), float(x) - now) for o, mm, x in rows if mm == m] for m in "rwi"}
        writer = live[WRITE][0] if live[WRITE] else None
        return rw_holders(self.name, epoch, writer, live[READ], live[INTENT])
