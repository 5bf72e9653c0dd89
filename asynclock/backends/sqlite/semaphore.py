"""Semaphores in the SQLite file: one row per (name, slot) in ``asynclock_permit``, apart
from the lock rows. A row is never deleted, so its token only rises (G2 per slot); a
released row has ``owner = ''`` and ``expires_at = 0``. A grant is one write transaction:
count the live rows, check their limit, count the live places of waiters ahead of the
asker in ``asynclock_permit_place`` (first come, first served: see
``_core/permit_store.py``), take the lowest free slot or keep the asker's place."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.permit_store import (
    Answer,
    Full,
    Granted,
    OtherLimit,
    PermitStore,
    permit_holder,
    place_ttl,
)

if TYPE_CHECKING:
    from . import SQLiteDriver

# Live permits of a name. Args: name, boot, now.
SQL_LIVE_PERMITS = (
    "SELECT slot, lim, expires_at FROM asynclock_permit "
    "WHERE name = ?1 AND owner <> '' AND boot = ?2 AND expires_at > ?3"
)
# Who holds the live permits of a name, by slot. Args: name, boot, now.
SQL_PERMIT_HOLDERS = (
    "SELECT slot, owner, token, expires_at, lim FROM asynclock_permit "
    "WHERE name = ?1 AND owner <> '' AND boot = ?2 AND expires_at > ?3 ORDER BY slot"
)
# The names with live permits, then those with live read-write holds. Args: boot, now.
SQL_HOLD_NAMES = (
    "SELECT DISTINCT 'p', name FROM asynclock_permit "
    "WHERE owner <> '' AND boot = ?1 AND expires_at > ?2 UNION ALL "
    "SELECT DISTINCT 'r', name FROM asynclock_rw_hold WHERE boot = ?1 AND expires_at > ?2"
)
# Drop the places that lapsed (or are from before a reboot). Args: name, boot, now.
SQL_PRUNE_PLACES = (
    "DELETE FROM asynclock_permit_place WHERE name = ?1 AND (boot <> ?2 OR expires_at <= ?3)"
)
# The live places ahead of :owner's (every live place if it has none): args name, owner.
# (Run after SQL_PRUNE_PLACES in the same transaction.)
SQL_AHEAD = (
    "SELECT count(*) FROM asynclock_permit_place WHERE name = ?1 AND seq < coalesce("
    "(SELECT seq FROM asynclock_permit_place WHERE name = ?1 AND owner = ?2), 9e18)"
)
# Keep :owner's place (or take one at the end). Args: name, owner, expires_at, boot.
SQL_KEEP_PLACE = (
    "INSERT INTO asynclock_permit_place (name, owner, seq, expires_at, boot) VALUES (?1, ?2, "
    "(SELECT coalesce(max(seq), 0) + 1 FROM asynclock_permit_place WHERE name = ?1), ?3, ?4) "
    "ON CONFLICT (name, owner) DO UPDATE SET expires_at = excluded.expires_at"
)
SQL_DROP_PLACE = "DELETE FROM asynclock_permit_place WHERE name = ? AND owner = ?"
# Take slot :slot (its token bumped in place). Args: name, slot, owner, expires_at, boot, lim.
SQL_TAKE_SLOT = (
    "INSERT INTO asynclock_permit (name, slot, owner, token, expires_at, boot, lim) "
    "VALUES (?1, ?2, ?3, 1, ?4, ?5, ?6) "
    "ON CONFLICT (name, slot) DO UPDATE SET owner = excluded.owner, "
    "token = asynclock_permit.token + 1, expires_at = excluded.expires_at, "
    "boot = excluded.boot, lim = excluded.lim "
    "RETURNING token"
)
# Renew our live permit. Args: expires_at, name, owner, token, boot, now.
SQL_EXTEND_PERMIT = (
    "UPDATE asynclock_permit SET expires_at = ?1 "
    "WHERE name = ?2 AND owner = ?3 AND token = ?4 AND boot = ?5 AND expires_at > ?6"
)
# Free our live permit (owner-checked; token if known). Args: name, owner, token, boot, now.
SQL_RELEASE_PERMIT = (
    "UPDATE asynclock_permit SET owner = '', expires_at = 0 "
    "WHERE name = ?1 AND owner = ?2 AND (?3 IS NULL OR token = ?3) "
    "AND boot = ?4 AND expires_at > ?5"
)


class SQLitePermits(PermitStore):
    """A semaphore's permits in the SQLite file (see the module)."""

    def __init__(self, driver: SQLiteDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.driver = driver
        self.display = driver.display

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        name, limit, boot = self.name, self.limit, self.driver.boot

        def attempt(db: sqlite3.Connection) -> Answer:
            now = time.monotonic()
            live = db.execute(SQL_LIVE_PERMITS, (name, boot, now)).fetchall()
            other = next((int(row[1]) for row in live if int(row[1]) != limit), None)
            if other is not None:
                return OtherLimit(other)
            db.execute(SQL_PRUNE_PLACES, (name, boot, now))
            ahead = int(db.execute(SQL_AHEAD, (name, owner)).fetchone()[0])
            if len(live) + ahead >= limit:
                if queue:
                    db.execute(SQL_KEEP_PLACE, (name, owner, now + place_ttl(ttl), boot))
                if len(live) < limit:
                    return Full(ahead=ahead)  # free, but for waiters ahead of us
                return Full(min(float(row[2]) for row in live) - now, ahead)
            db.execute(SQL_DROP_PLACE, (name, owner))
            taken = {int(row[0]) for row in live}
            slot = next(s for s in range(limit) if s not in taken)
            args = (name, slot, owner, now + ttl, boot, limit)
            token = int(db.execute(SQL_TAKE_SLOT, args).fetchone()[0])
            return Granted(slot, token)

        return await self.driver._write(attempt)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        boot = self.driver.boot

        def renew(db: sqlite3.Connection) -> list[ExtendResult]:
            now = time.monotonic()
            out: list[ExtendResult] = []
            for ref in leases:
                args = (now + ref.ttl, self.name, ref.owner, ref.token, boot, now)
                cur = db.execute(SQL_EXTEND_PERMIT, args)
                out.append(True if cur.rowcount == 1 else Refused("permit row expired or taken"))
            return out

        return await self.driver._write(renew)

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        args = (self.name, owner, token, self.driver.boot, time.monotonic())
        cursor = await self.driver._statement(SQL_RELEASE_PERMIT, args)
        return cursor.rowcount == 1

    async def withdraw(self, owner: str) -> None:
        await self.driver._statement(SQL_DROP_PLACE, (self.name, owner))

    async def holders(self) -> list[Holder]:
        now = time.monotonic()  # system-wide on Linux: the clock every process's rows use
        args = (self.name, self.driver.boot, now)
        db = self.driver.db
        rows = await self.driver._retry_busy(
            lambda: db.execute(SQL_PERMIT_HOLDERS, args).fetchall(), "listing permits"
        )
        return [
            permit_holder(self.name, int(s), str(o), int(t), float(x) - now, int(lim))
            for s, o, t, x, lim in rows
        ]


async def hold_names(driver: SQLiteDriver) -> tuple[list[str], list[str]]:
    """``Driver.hold_names`` of the SQLite file: the names with live permits or holds."""
    db, args = driver.db, (driver.boot, time.monotonic())
    rows = await driver._retry_busy(
        lambda: db.execute(SQL_HOLD_NAMES, args).fetchall(), "listing semaphores"
    )
    return [str(n) for k, n in rows if k == "p"], [str(n) for k, n in rows if k == "r"]
