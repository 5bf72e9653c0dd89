"""Read-write locks on PostgreSQL (both modes: a hold is a row with an expiry, whatever
the mode of the locks; the rules are :mod:`asynclock._core.rw_store`'s), apart from the
lock tables:

* ``asynclock_rw`` — one row per name: ``epoch``, the last write hold's token. Never
  deleted and LOGGED, so the epoch only rises, across crashes too (G2 for writers);
* ``asynclock_rw_hold`` — one row per hold or intent: ``mode`` is ``r`` (a reader), ``w``
  (the writer) or ``i`` (a waiting writer's intent), ``token`` the epoch it holds.

A grant is one transaction serialised per name by a transaction advisory lock: it drops
the name's expired rows, locks the live ones (``FOR UPDATE``: a renewal in flight is
waited for, so an expiry is judged on the row's latest version), decides and writes.
Renewals and releases are owner-, mode- and token-checked single statements. The tables
are created on first use. A release (or an intent withdrawn) NOTIFYs the channel of the
read-write lock's reserved wake name (``_core/wakes.py``) when a backend waits for it, as
a lock's release does; its waiters watch it with the driver's lock watch (LISTEN)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import SENT_AT, ExtendResult, LeaseRef, Refused
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
from .connection import _CONNECTION_ERRORS
from .sql import _SCHEMA_KEY
from .tokens import _name_bytes, notify_channel, waiter_key
from .xact import transaction

if TYPE_CHECKING:
    from .connection import PostgresDriver

INTENT = "i"

SQL_RW_SCHEMA = f"""
SELECT pg_advisory_xact_lock({_SCHEMA_KEY});
CREATE TABLE IF NOT EXISTS asynclock_rw (
    name       bytea PRIMARY KEY,
    epoch      bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS asynclock_rw_hold (
    name       bytea NOT NULL,
    owner      text NOT NULL,
    mode       text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (name, owner)
)
"""

# Inside the grant's transaction, after pg_advisory_xact_lock(the name's key). Args: $1
# name. Drops the name's expired rows.
SQL_RW_EXPIRE = "DELETE FROM asynclock_rw_hold WHERE name = $1 AND expires_at <= clock_timestamp()"
# Then the live rows, locked, with the seconds each has left. Args: $1 name.
SQL_RW_LIVE = """
SELECT mode, extract(epoch FROM expires_at - clock_timestamp())::float8 AS left_s
FROM asynclock_rw_hold WHERE name = $1 FOR UPDATE
"""
# The name's epoch (no row: none). Args: $1 name.
SQL_RW_EPOCH = "SELECT epoch FROM asynclock_rw WHERE name = $1"
# The next epoch. Args: $1 name. Returns it.
SQL_RW_BUMP = """
INSERT INTO asynclock_rw AS r (name, epoch) VALUES ($1, 1)
ON CONFLICT (name) DO UPDATE SET epoch = r.epoch + 1 RETURNING epoch
"""
# A hold or an intent (replacing the owner's intent). Args: $1 name, $2 owner, $3 mode,
# $4 token, $5 ttl_ms.
SQL_RW_PUT = """
INSERT INTO asynclock_rw_hold (name, owner, mode, token, expires_at)
VALUES ($1, $2, $3, $4, clock_timestamp() + $5 * interval '1 millisecond')
ON CONFLICT (name, owner) DO UPDATE SET mode = excluded.mode, token = excluded.token,
    expires_at = excluded.expires_at
"""
# G5/G7: renew our live holds of one mode. Args: $1 name, $2 mode, $3 owners, $4 tokens,
# $5 ttl_ms. Returns the ordinal of each renewed one.
SQL_RW_EXTEND = """
UPDATE asynclock_rw_hold AS h
SET expires_at = clock_timestamp() + x.ttl * interval '1 millisecond'
FROM unnest($3::text[], $4::bigint[], $5::float8[]) WITH ORDINALITY AS x(owner, token, ttl, i)
WHERE h.name = $1 AND h.mode = $2 AND h.owner = x.owner AND h.token = x.token
  AND h.expires_at > clock_timestamp()
RETURNING x.i
"""
# G5: free our live hold (or withdraw our intent). Args: $1 name, $2 owner, $3 mode, $4
# token or NULL, then the wake name's channel ($5) and waiter key ($6, $7): NOTIFYs, as a
# lock's release does, when a row was removed and a backend waits. A row if removed.
SQL_RW_RELEASE = """
WITH d AS (
    DELETE FROM asynclock_rw_hold
    WHERE name = $1 AND owner = $2 AND mode = $3 AND ($4::bigint IS NULL OR token = $4)
      AND expires_at > clock_timestamp()
    RETURNING 1 AS freed
)
SELECT d.freed FROM d
LEFT JOIN LATERAL (SELECT pg_notify($5, '') WHERE NOT pg_try_advisory_xact_lock($6, $7)) AS n
    ON true
"""

# Who holds it, with the epoch. Args: $1 name.
SQL_RW_HOLDERS = """
SELECT owner, mode, extract(epoch FROM expires_at - clock_timestamp())::float8 AS left_s,
       (SELECT epoch FROM asynclock_rw WHERE name = $1) AS epoch
FROM asynclock_rw_hold WHERE name = $1 AND expires_at > clock_timestamp()
"""


def grant_key(name: str) -> int:
    """The transaction advisory lock key that serialises the grants of one rwlock."""
    digest = hashlib.sha256(b"asynclock:rwlock:" + _name_bytes(name)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresRW(RWStore):
    """A read-write lock in ``asynclock_rw`` and ``asynclock_rw_hold`` (see the module)."""

    #: Grants wait for the pinned connection; each sets SENT_AT when it has it.
    queues_locally = True

    def __init__(self, driver: PostgresDriver, name: str) -> None:
        super().__init__(name)
        self.driver = driver
        self.display = driver.display
        self._name = _name_bytes(name)
        self._key = grant_key(name)
        self.waker = driver
        self._notify = (notify_channel(self.wake_name), *waiter_key(self.wake_name))

    async def _schema(self) -> None:
        driver = self.driver
        if getattr(driver, "_rw_tables", False):
            return
        async with driver._io:
            conn = await driver._main()
            try:
                async with transaction(conn):
                    await conn.execute(SQL_RW_SCHEMA)
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable("creating the rwlock tables", exc) from exc
        driver._rw_tables = True  # type: ignore[attr-defined]

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        await self._schema()
        driver, name, ttl_ms = self.driver, self._name, ttl * 1000.0
        async with driver._io:
            SENT_AT.set(driver.clock.now())  # a grant below expires after this
            conn = await driver._main()
            try:
                async with transaction(conn):
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", self._key)
                    await conn.execute(SQL_RW_EXPIRE, name)
                    live = await conn.fetch(SQL_RW_LIVE, name)
                    left = {m: [float(r["left_s"]) for r in live if r["mode"] == m] for m in "rwi"}
                    busy: Held | None = None
                    if left[WRITE]:
                        busy = Held(WRITER_HOLDS, left[WRITE][0])
                    elif mode == READ and left[INTENT]:
                        return Held(WRITER_WAITS)
                    elif mode == WRITE and left[READ]:
                        busy = Held(READERS_HOLD, min(left[READ]))
                    if busy is not None:
                        if intend:
                            await conn.execute(SQL_RW_PUT, name, owner, INTENT, 0, ttl_ms)
                        return busy
                    if mode == READ:
                        token = int(await conn.fetchval(SQL_RW_EPOCH, name) or 0)
                    else:
                        token = int(await conn.fetchval(SQL_RW_BUMP, name))
                    await conn.execute(SQL_RW_PUT, name, owner, mode, token, ttl_ms)
                    return token
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable("rwlock grant failed", exc) from exc

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        rows = await self.driver._run(
            "rwlock renewal failed",
            "fetch",
            SQL_RW_EXTEND,
            self._name,
            mode,
            [r.owner for r in leases],
            [r.token for r in leases],
            [r.ttl * 1000.0 for r in leases],
            first=True,
        )
        done = {int(r["i"]) for r in rows}
        gone = Refused("the hold's row expired or was freed")
        return [True if i in done else gone for i in range(1, len(leases) + 1)]

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        await self._schema()
        row = await self.driver._run(
            "rwlock release failed",
            "fetchval",
            SQL_RW_RELEASE,
            self._name,
            owner,
            mode,
            token,
            *self._notify,
        )
        return row is not None

    async def withdraw(self, owner: str) -> None:
        await self.release_hold(INTENT, owner, None)

    async def holders(self) -> list[Holder]:
        await self._schema()
        rows = await self.driver._run("listing holds failed", "fetch", SQL_RW_HOLDERS, self._name)
        if not rows:
            return []
        live = {m: [(r["owner"], r["left_s"]) for r in rows if r["mode"] == m] for m in "rwi"}
        writer = live[WRITE][0] if live[WRITE] else None
        return rw_holders(self.name, int(rows[0]["epoch"] or 0), writer, live[READ], live[INTENT])
