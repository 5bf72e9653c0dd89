"""Semaphores on PostgreSQL (both modes: a permit is a row with an expiry, whatever the
mode of the locks): one row per (name, slot) in ``asynclock_permit``, apart from the lock
tables. A row is never deleted, so its token only rises (G2 per slot); the table is
LOGGED, so a crash does not reset it. A released row has ``owner = ''``.

A grant is one transaction serialised per name by a transaction advisory lock (so two
grants never both see the last free slot, and the limit of the live permits is checked
against every committed grant): it counts the live rows, checks their limit and takes the
lowest free slot, in one statement. The tables are created on first use.

Waiters are served first come, first served (``_core/permit_store.py``): their places are
rows of ``asynclock_permit_place`` (owner, name, seq, expires_at on the server's clock;
keyed by owner, which is unique per acquisition), read and written by the same grant
statement under the same advisory lock, so the queue and the limit change together or not
at all. A grant's cost does not grow with the queue: each read of the place table is the
owner's key or an ordered index range that stops at its LIMIT (at most ``limit`` live
places ahead, at most 100 lapsed ones deleted), and the transaction pins those plans
(:data:`SQL_P_LOCK`) whatever the table's statistics. A withdrawal is one DELETE.

A release NOTIFYs the channel of the semaphore's reserved wake name (``_core/wakes.py``)
when a backend waits for it (the lock's rule: the waiter key is held), which its waiters
watch with the driver's lock watch (LISTEN)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import SENT_AT, ExtendResult, LeaseRef, Refused
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
from .connection import _CONNECTION_ERRORS
from .sql import _SCHEMA_KEY
from .tokens import _name_bytes, notify_channel, waiter_key
from .xact import transaction

if TYPE_CHECKING:
    from .connection import PostgresDriver

SQL_P_SCHEMA = f"""
SELECT pg_advisory_xact_lock({_SCHEMA_KEY});
CREATE TABLE IF NOT EXISTS asynclock_permit (
    name       bytea NOT NULL,
    slot       integer NOT NULL,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL,
    lim        integer NOT NULL,
    PRIMARY KEY (name, slot)
);
DO $$ BEGIN
    -- Not CREATE INDEX IF NOT EXISTS: that takes a SHARE lock on the table before it looks
    -- for the index, so every new process would wait for the grants in flight, and the
    -- grants after it for it (with a grant waiting for the name's advisory lock: a cycle).
    IF to_regclass('asynclock_permit_place') IS NULL THEN
        CREATE TABLE asynclock_permit_place (
            owner      text PRIMARY KEY,
            name       bytea NOT NULL,
            seq        bigint NOT NULL,
            expires_at timestamptz NOT NULL
        );
        CREATE INDEX asynclock_permit_place_order ON asynclock_permit_place (name, seq);
        CREATE INDEX asynclock_permit_place_lapse ON asynclock_permit_place (name, expires_at);
    END IF;
END $$
"""

# A grant's first statement: the name's advisory lock (args: $1 the key), and plans for
# the grant that read the place table only through its indexes in order (by seq, by
# expiry), stopping at the LIMIT: without these, a table with stale statistics (a queue
# that grew since the last ANALYZE) gets a bitmap scan and a sort of every place of the
# name, per grant. JIT off: the disabled plan types' costs would otherwise JIT-compile
# every grant (0.4 s instead of 0.4 ms). Transaction-local (SET LOCAL): through a
# transaction pooler too.
SQL_P_LOCK = """
SELECT pg_advisory_xact_lock($1), set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true), set_config('enable_sort', 'off', true),
       set_config('jit', 'off', true)
"""

# Inside the grant's transaction, after SQL_P_LOCK. Args: $1 name, $2 owner, $3 ttl_ms,
# $4 limit, $5 queue (keep a place if not granted), $6 the place's ttl_ms. One row: slot
# and token if granted; else other (the limit of the live permits, if not $4) or left_s
# (seconds until the first one expires, when all are held).
# First come, first served: granted only when the live permits plus the live places ahead
# of $2's (all of them if it has none) are below $4. Counting those places stops at the
# number of free permits, so no step reads more than an index range of at most $4 live
# rows, and at most 100 lapsed places, which it deletes (by ctid: a TID scan).
# One timestamp (now) for the whole statement: a place is live or lapsed for all of it.
SQL_P_GRANT = """
WITH now AS (
    SELECT clock_timestamp() AS t
), live AS (
    SELECT slot, lim, expires_at FROM asynclock_permit
    WHERE name = $1 AND owner <> '' AND expires_at > (SELECT t FROM now)
), other AS (
    SELECT lim FROM live WHERE lim <> $4 LIMIT 1
), mine AS (
    SELECT ctid AS tid, CASE WHEN name = $1 AND expires_at > (SELECT t FROM now) THEN seq END
        AS seq
    FROM asynclock_permit_place WHERE owner = $2
), ahead AS (
    SELECT 1 FROM asynclock_permit_place
    WHERE name = $1 AND seq < coalesce((SELECT seq FROM mine), 9223372036854775807)
      AND expires_at > (SELECT t FROM now)
    ORDER BY name, seq LIMIT greatest($4 - (SELECT count(*) FROM live), 0)
), go AS (
    SELECT NOT EXISTS (SELECT 1 FROM other) AS same,
           (SELECT count(*) FROM live) + (SELECT count(*) FROM ahead) < $4 AS ok
), free AS (
    SELECT s FROM generate_series(0, $4 - 1) AS s
    WHERE (SELECT same AND ok FROM go)
      AND NOT EXISTS (SELECT 1 FROM live WHERE live.slot = s)
    ORDER BY s LIMIT 1
), ins AS (
    INSERT INTO asynclock_permit AS p (name, slot, owner, token, expires_at, lim)
    SELECT $1, s, $2, 1, clock_timestamp() + $3 * interval '1 millisecond', $4 FROM free
    ON CONFLICT (name, slot) DO UPDATE SET owner = excluded.owner, token = p.token + 1,
        expires_at = excluded.expires_at, lim = excluded.lim
    RETURNING p.slot, p.token
), granted AS (
    DELETE FROM asynclock_permit_place
    WHERE ctid = (SELECT tid FROM mine) AND name = $1 AND (SELECT same AND ok FROM go)
), lapsed AS (
    DELETE FROM asynclock_permit_place
    WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM asynclock_permit_place
        WHERE name = $1 AND expires_at <= (SELECT t FROM now) AND owner <> $2
        ORDER BY name, expires_at LIMIT 100))
), keep AS (
    INSERT INTO asynclock_permit_place AS q (owner, name, seq, expires_at)
    SELECT $2, $1,
           coalesce((SELECT seq FROM asynclock_permit_place WHERE name = $1
                     ORDER BY name DESC, seq DESC LIMIT 1), 0) + 1,
           (SELECT t FROM now) + $6 * interval '1 millisecond'
    WHERE $5 AND (SELECT same AND NOT ok FROM go)
    ON CONFLICT (owner) DO UPDATE SET name = excluded.name, expires_at = excluded.expires_at,
        seq = CASE WHEN (SELECT seq FROM mine) IS NOT NULL THEN q.seq ELSE excluded.seq END
)
SELECT (SELECT slot FROM ins) AS slot, (SELECT token FROM ins) AS token,
       (SELECT lim FROM other) AS other,
       (SELECT extract(epoch FROM min(expires_at) - clock_timestamp()) FROM live
        HAVING count(*) >= $4)::float8 AS left_s
"""

# G5/G7: renew our live permits. Args: $1 name, $2 owners, $3 tokens, $4 ttl_ms. Returns
# the ordinal of each renewed one.
SQL_P_EXTEND = """
UPDATE asynclock_permit AS p
SET expires_at = clock_timestamp() + x.ttl * interval '1 millisecond'
FROM unnest($2::text[], $3::bigint[], $4::float8[]) WITH ORDINALITY AS x(owner, token, ttl, i)
WHERE p.name = $1 AND p.owner = x.owner AND p.token = x.token
  AND p.expires_at > clock_timestamp()
RETURNING x.i
"""

# G5: free our live permit. Args: $1 name, $2 owner, $3 token or NULL, then the wake
# name's channel ($4) and waiter key ($5, $6): NOTIFYs, as a lock's release does, when a
# permit was freed and a backend waits (it holds the waiter key shared). A row if freed.
SQL_P_RELEASE = """
WITH d AS (
    UPDATE asynclock_permit SET owner = '', expires_at = 'epoch'
    WHERE name = $1 AND owner = $2 AND ($3::bigint IS NULL OR token = $3)
      AND expires_at > clock_timestamp()
    RETURNING 1 AS freed
)
SELECT d.freed FROM d
LEFT JOIN LATERAL (SELECT pg_notify($4, '') WHERE NOT pg_try_advisory_xact_lock($5, $6)) AS n
    ON true
"""

# Who holds the live permits of a name, by slot. Args: $1 name.
SQL_P_HOLDERS = """
SELECT slot, owner, token, lim,
       extract(epoch FROM expires_at - clock_timestamp())::float8 AS left_s
FROM asynclock_permit
WHERE name = $1 AND owner <> '' AND expires_at > clock_timestamp() ORDER BY slot
"""

# The names with live permits (kind 'p'), then those with live read-write holds ('r'),
# for Driver.hold_names (both modes: rows with an expiry either way). No args.
SQL_HOLD_NAMES = """
SELECT DISTINCT 'p' AS kind, name FROM asynclock_permit
WHERE owner <> '' AND expires_at > clock_timestamp()
UNION ALL
SELECT DISTINCT 'r', name FROM asynclock_rw_hold WHERE expires_at > clock_timestamp()
"""

# Withdraw a waiter's place (it gave up). Args: $1 name, $2 owner.
SQL_P_WITHDRAW = "DELETE FROM asynclock_permit_place WHERE owner = $2 AND name = $1"


def grant_key(name: str) -> int:
    """The transaction advisory lock key that serialises the grants of one semaphore."""
    digest = hashlib.sha256(b"asynclock:semaphore:" + _name_bytes(name)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresPermits(PermitStore):
    """A semaphore's permits in ``asynclock_permit`` (see the module)."""

    #: Grants wait for the pinned connection; each sets SENT_AT when it has it.
    queues_locally = True

    def __init__(self, driver: PostgresDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.driver = driver
        self.display = driver.display
        self._name = _name_bytes(name)
        self._key = grant_key(name)
        self.waker = driver
        self._notify = (notify_channel(self.wake_name), *waiter_key(self.wake_name))

    async def _schema(self) -> None:
        driver = self.driver
        if getattr(driver, "_permit_table", False):
            return
        async with driver._io:
            conn = await driver._main()
            try:
                async with transaction(conn):
                    await conn.execute(SQL_P_SCHEMA)
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable("creating the semaphore tables", exc) from exc
        driver._permit_table = True  # type: ignore[attr-defined]

    async def withdraw(self, owner: str) -> None:
        await self._schema()
        await self.driver._run(
            "withdrawing a semaphore waiter failed", "execute", SQL_P_WITHDRAW, self._name, owner
        )

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        await self._schema()
        driver = self.driver
        async with driver._io:
            SENT_AT.set(driver.clock.now())  # a grant below expires after this
            conn = await driver._main()
            try:
                async with transaction(conn):
                    await conn.execute(SQL_P_LOCK, self._key)
                    row = await conn.fetchrow(
                        SQL_P_GRANT,
                        self._name,
                        owner,
                        ttl * 1000.0,
                        self.limit,
                        queue,
                        place_ttl(ttl) * 1000.0,
                    )
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable("semaphore grant failed", exc) from exc
        assert row is not None
        if row["token"] is not None:
            return Granted(int(row["slot"]), int(row["token"]))
        if row["other"] is not None:
            return OtherLimit(int(row["other"]))
        return Full(None if row["left_s"] is None else float(row["left_s"]))

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        rows = await self.driver._run(
            "semaphore renewal failed",
            "fetch",
            SQL_P_EXTEND,
            self._name,
            [r.owner for r in leases],
            [r.token for r in leases],
            [r.ttl * 1000.0 for r in leases],
            first=True,
        )
        done = {int(r["i"]) for r in rows}
        gone = Refused("the permit row expired or was taken over")
        return [True if i in done else gone for i in range(1, len(leases) + 1)]

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        await self._schema()
        row = await self.driver._run(
            "semaphore release failed",
            "fetchval",
            SQL_P_RELEASE,
            self._name,
            owner,
            token,
            *self._notify,
        )
        return row is not None

    async def holders(self) -> list[Holder]:
        await self._schema()
        rows = await self.driver._run("listing permits failed", "fetch", SQL_P_HOLDERS, self._name)
        return [
            permit_holder(self.name, r["slot"], r["owner"], r["token"], r["left_s"], r["lim"])
            for r in rows
        ]


async def hold_names(driver: PostgresDriver) -> tuple[list[str], list[str]]:
    """``Driver.hold_names`` on PostgreSQL (either mode): the names with live rows."""
    from .rwlock import PostgresRW

    await PostgresPermits(driver, "", 1)._schema()
    await PostgresRW(driver, "")._schema()
    rows = await driver._run("listing semaphores and rwlocks failed", "fetch", SQL_HOLD_NAMES)
    found = [(r["kind"], bytes(r["name"]).decode("utf-8", "surrogatepass")) for r in rows]
    return [n for k, n in found if k == "p"], [n for k, n in found if k == "r"]
