"""``postgresql://`` — locks in the PostgreSQL database you already run (asyncpg).

Two modes, chosen with ``?mode=`` in the URL:

``mode=session`` (default): **session advisory locks.** One pinned connection per backend
carries every lock it holds (``pg_try_advisory_lock``). The key is 64 bits of SHA-256 of
the name (:func:`lock_key`). The fencing token is taken in the same statement that takes
the lock, and only when the lock was granted (see "Tokens" below), together with a
*token lock* that lets other sessions validate it. Each heartbeat asks ``pg_locks``, in
one statement for every lease, whether *this backend pid* still holds each key, so a
dropped connection, a ``pg_terminate_backend`` or a pooler that moved the session is a
definite loss (G4, G5). Every statement sets ``idle_session_timeout`` to the longest ttl
the connection holds, so the server frees the locks of a client that went silent (hung,
partitioned, SIGSTOPped) at most ``ttl`` after its last statement, which is after that
client's own local deadline (G3). Needs a direct connection or a *session*-mode pooler;
a transaction-mode pooler is detected at open and refused.

``mode=lease``: **a lease table** (``asynclock_lease``: name, owner, token, ``expires_at``
on the server's clock, ``clock_timestamp()``). Acquire, extend and release are single
conditional statements, so it works through any pooler (with a transaction pooler: no
LISTEN, bounded polling, and asyncpg's statement cache off). Expiry trusts the server's
wall clock not to jump. The lease table is UNLOGGED, so an acquire waits for no WAL
flush; crash recovery empties it, and then no lease is granted for the longest lease ttl
ever granted (kept in the logged ``asynclock_lease_ttl``, raised with a synchronous commit
before the first lease that needs it), counted from the first acquire after recovery (the
range row's ``grace_until``): every lease from before the crash has expired by then (G1).

Tokens (every mode and :func:`xact_lock`): ``token = base + nextval('asynclock_token_seq')``,
valid while ``token <= lim``, where ``(base, lim)`` is the one row of
``asynclock_token_range``. The sequence and the range row are UNLOGGED (before PostgreSQL
15 the sequence is logged: as safe, since recovery still empties the range row, only
slower), so taking a token writes no WAL, takes no transaction id and waits for no flush.
Crash recovery empties the range row (and resets the sequence).
Then, on first use, and every :data:`EPOCH_SPAN` (2**40) tokens, :data:`SQL_TOKEN_EPOCH`
appends epoch ``max + 1`` to the logged table ``asynclock_token_epoch`` and sets ``lim``
to that epoch's end, ``(epoch + 1) * 2**40 - 1`` (a new range row starts at ``epoch *
2**40 + 1``), committing synchronously. So every token handed out is <= ``lim``, which is
never visible before its epoch row is on disk, and after a crash the next epoch starts
above all of them (G2), without a clock. One sequence for all names (so a ``token_scope``
needs no counter of its own: its tokens rise like any name's): a name's tokens
rise with gaps. Not ``CACHE > 1`` (per-session caches would hand out values out of order),
and not the sequence alone: nextval logs only every 32nd value, and the values between
are handed out without waiting for that record's flush (with ``synchronous_commit = off``,
or while the transaction that logged it has not committed yet), so a crash could repeat
them.

Waiting: waiters ``LISTEN`` on ``asynclock_<16 hex digits of the key>`` on a second
connection (one per backend), hold the name's :func:`waiter_key` shared there, and retry at
least every ``poll`` seconds (a holder whose connection died sends no notification). A
release NOTIFYs only when its probe of the waiter key finds a waiter.

Tables are created on first use (idempotent, serialised by a transaction advisory lock so
concurrent first use is safe); :func:`ensure_schema` does the same for migrations.

URL: ``postgresql://user:password@host:port/database?mode=session|lease&poll=0.2
&connect_timeout=10&check_pooler=true``. Other query parameters go to asyncpg/libpq
(``sslmode``, ``application_name``, ...).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from .._core.asyncio_only import require_asyncio
from .._core.driver import Busy, Driver, ExtendResult, LeaseRef, Refused
from .._core.exceptions import BackendUnavailable, LockHeld
from .._core.holder import Holder
from .._core.validation import check_name, check_seconds

__all__ = (
    "KEY_SQL",
    "PoolerDetected",
    "PostgresDriver",
    "driver_from_url",
    "ensure_schema",
    "lock_key",
    "notify_channel",
    "waiter_key",
    "xact_lock",
)

logger = logging.getLogger("asynclock.postgres")

MODES = ("session", "lease")
_MASK64 = (1 << 64) - 1

#: The same key as :func:`lock_key`, computed in SQL from a text parameter ``$1``.
KEY_SQL = "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint"

#: Key of the transaction advisory lock that serialises schema creation.
_SCHEMA_KEY = 0x6173796E636C6F63  # "asynclock" in ASCII, first 8 bytes


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


# -- schema ------------------------------------------------------------------------------

#: Tokens of one epoch lie in ``[epoch * EPOCH_SPAN, (epoch + 1) * EPOCH_SPAN)`` (2**40).
EPOCH_SPAN = 1 << 40

# The token source of every mode and of xact_lock (G2; "Tokens" in the module docstring).
# ``asynclock_token_seq`` counts acquisitions: UNLOGGED (PostgreSQL >= 15), so nextval
# writes no WAL and takes no transaction id; crash recovery resets it. The one row of
# ``asynclock_token_range`` (UNLOGGED too, so it is emptied by the same recovery) says what
# to add to it (``base``) and how far tokens may go (``lim``). ``asynclock_token_epoch``
# (logged, append-only) reserves ``[epoch * EPOCH_SPAN, (epoch + 1) * EPOCH_SPAN)`` per row;
# a range row is written only in the transaction that inserts the epoch row backing its
# ``lim``, committed synchronously. Never delete these (tokens would go back to 1).
# The range row also carries mode lease's crash grace (G1, "Leases across crashes"):
# ``lease_ttl_ms``, a copy of ``asynclock_lease_ttl.ttl_ms`` (logged, written only by
# synchronous commits: the longest lease ttl ever granted), and ``grace_until``, set when
# the row is created: no lease is granted before it.
SCHEMA_TOKENS = """
CREATE {persistence} SEQUENCE IF NOT EXISTS asynclock_token_seq;
CREATE TABLE IF NOT EXISTS asynclock_token_epoch (
    epoch      bigint PRIMARY KEY,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS asynclock_lease_ttl (
    one    boolean PRIMARY KEY DEFAULT true CHECK (one),
    ttl_ms float8 NOT NULL
);
CREATE UNLOGGED TABLE IF NOT EXISTS asynclock_token_range (
    one          boolean PRIMARY KEY DEFAULT true CHECK (one),
    base         bigint NOT NULL,
    lim          bigint NOT NULL,
    lease_ttl_ms float8 NOT NULL,
    grace_until  timestamptz NOT NULL
)
"""
# Leases of mode lease (tokens from the shared source above). UNLOGGED: a lease commits
# without waiting for a WAL flush, and crash recovery empties the table; the grace on the
# range row keeps a holder from before the crash and a new one apart.
SCHEMA_LEASE = """
CREATE UNLOGGED TABLE IF NOT EXISTS asynclock_lease (
    name       bytea PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
)
"""

# -- tokens: statements ------------------------------------------------------------------

# The next token, after a CTE ``l`` with a boolean ``ok`` (take one only if true): one row
# (token, lim) if the range row exists. The token is valid only if token <= lim; otherwise,
# or with no row, run SQL_TOKEN_EPOCH first. nextval is not transactional: a token is never
# handed out twice, even when the caller's transaction rolls back.
_NEXT = """
t AS (SELECT r.base + nextval('asynclock_token_seq') AS token, r.lim, r.lease_ttl_ms,
             r.grace_until
      FROM l, asynclock_token_range AS r WHERE l.ok)"""
# The hold's *token lock*: a shared session advisory lock (``_XACT_`` for xact_lock) on
# ``hashint8extended(token, key)``, taken with the lock and released with it, so that
# another session can tell which token the holder of a key has (G9, SQL_S_VALIDATE). It
# shows in pg_locks as an advisory ShareLock with objsubid 1. CASE fixes the order: the
# token lock only for a token that will be handed out. Returns the token or NULL.
_TOKEN_LOCKED = """(SELECT CASE WHEN t.token > t.lim THEN NULL
              WHEN pg_try_advisory_{scope}lock_shared(hashint8extended(t.token, $1)) IS NOT NULL
              THEN t.token END FROM t)"""
# G2 after a crash, on first use, and every EPOCH_SPAN tokens. No args. Appends epoch
# max + 1 (durably: forced synchronous commit, and the logged insert guarantees this
# transaction waits for its WAL flush), then creates the range row with base = epoch *
# EPOCH_SPAN - nextval (so the next token is epoch * EPOCH_SPAN + 1) or, if a range row
# exists (tokens reached ``lim``, or a concurrent first use won), raises its ``lim`` to the
# new epoch's end and keeps the rest. Returns (base, lim), or no row if a concurrent caller
# appended the same epoch first (ON CONFLICT waited for it): run it again. Tokens handed
# out are <= lim <= (max epoch + 1) * EPOCH_SPAN - 1, and that epoch row is on disk before
# any lim it backs is visible, so after crash recovery (which empties the range row and
# resets the sequence) every new token is above every earlier one.
# G1 for mode lease: a new range row (so: after crash recovery, which also emptied
# asynclock_lease) starts a grace of the longest lease ttl ever granted, read from the
# durable table; every lease from before the crash had ttl <= it and was granted before
# now, so it has expired when the grace ends.
SQL_TOKEN_EPOCH = f"""
WITH e AS (
    INSERT INTO asynclock_token_epoch (epoch)
    SELECT coalesce(max(epoch) + 1, 0) FROM asynclock_token_epoch
    ON CONFLICT (epoch) DO NOTHING
    RETURNING epoch
),
d AS (SELECT coalesce((SELECT ttl_ms FROM asynclock_lease_ttl), 0) AS ttl_ms),
r AS (
    INSERT INTO asynclock_token_range AS r (one, base, lim, lease_ttl_ms, grace_until)
    SELECT true, e.epoch * {EPOCH_SPAN} - nextval('asynclock_token_seq'),
           (e.epoch + 1) * {EPOCH_SPAN} - 1,
           d.ttl_ms, clock_timestamp() + d.ttl_ms * interval '1 millisecond'
    FROM e, d
    ON CONFLICT (one) DO UPDATE SET lim = greatest(r.lim, EXCLUDED.lim)
    RETURNING r.base, r.lim
)
SELECT base, lim,
       set_config('synchronous_commit',
                  CASE current_setting('synchronous_commit')
                  WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END,
                  true) AS sync
FROM r
"""
# Before the first lease whose ttl exceeds the range row's copy of the longest ttl: raise
# the durable maximum (forced synchronous commit of a logged row) and the copy, so the
# copy never exceeds what is on disk. Args: $1 ttl (ms).
SQL_L_TTL = """
WITH d AS (
    INSERT INTO asynclock_lease_ttl AS d (one, ttl_ms) VALUES (true, $1)
    ON CONFLICT (one) DO UPDATE SET ttl_ms = greatest(d.ttl_ms, EXCLUDED.ttl_ms)
    RETURNING d.ttl_ms,
              set_config('synchronous_commit',
                         CASE current_setting('synchronous_commit')
                         WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END,
                         true) AS sync
)
UPDATE asynclock_token_range AS r SET lease_ttl_ms = greatest(r.lease_ttl_ms, d.ttl_ms) FROM d
"""

# -- mode session: statements ------------------------------------------------------------

_S_TAKE = f"""{_NEXT}
SELECT l.ok, {_TOKEN_LOCKED.format(scope="")} AS token FROM l"""
# G1 + G2 in one round trip. Args: $1 key bigint, $2 idle_session_timeout (ms, text). Takes
# the session lock if free and only then a token and its token lock. Returns (ok, token):
# (false, NULL) busy; (true, token) granted; (true, NULL) granted, but the range row is
# missing or used up: run SQL_TOKEN_EPOCH, then SQL_S_TOKEN. No transaction id, no WAL.
SQL_S_ACQUIRE = f"""
WITH s AS (SELECT set_config('idle_session_timeout', $2, false)),
     l AS (SELECT pg_try_advisory_lock($1) AS ok FROM s),{_S_TAKE}"""
# The same when idle_session_timeout is already right (or the server predates it, < 14).
SQL_S_ACQUIRE_PLAIN = f"WITH l AS (SELECT pg_try_advisory_lock($1) AS ok),{_S_TAKE}"
# A token for a lock already held. Args: $1 key. Returns (ok, token) as above.
SQL_S_TOKEN = f"WITH l AS (SELECT true AS ok),{_S_TAKE}"
# G4/G7 renewal of every lease in one round trip. Args: $1 keys bigint[], $2 idle ms (text).
# Returns one row: the keys of $1 that *this backend pid* no longer holds.
_MISSING = """array(SELECT k FROM unnest($1::bigint[]) AS k
             EXCEPT
             SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks AS l
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
               AND l.mode = 'ExclusiveLock' AND l.pid = pg_backend_pid()) AS missing"""
SQL_S_CHECK = f"SELECT set_config('idle_session_timeout', $2, false) AS idle, {_MISSING}"
# The same when idle_session_timeout needs no change. Args: $1 keys bigint[].
SQL_S_CHECK_PLAIN = f"SELECT {_MISSING}"
# G5 release. Args: $1 key, $2 channel, $3 and $4 the waiter key (:func:`waiter_key`), $5
# the hold's token (NULL if unknown: then run SQL_S_DROP_TOKEN_LOCKS). Drops the token lock
# (first, so that it never outlives the lock), then unlocks our session's hold. Returns NULL
# if the lock was not held, false if it was and nobody waits, true if it was and waiters
# were notified. A waiting backend holds a shared lock on the waiter key (taken after its
# LISTEN, before its next try), so the exclusive probe fails exactly when someone may be
# waiting; only then does the statement NOTIFY, which costs a transaction id, a commit
# record and the notify queue's lock. That commit does not wait for the WAL flush: nothing
# here needs to survive a crash (the unlock is not transactional). Without a NOTIFY the
# statement writes nothing.
SQL_S_RELEASE = """
WITH u AS (SELECT pg_advisory_unlock_shared(hashint8extended($5::bigint, $1)) AS token_lock)
SELECT CASE WHEN NOT pg_advisory_unlock($1) THEN NULL
            WHEN pg_try_advisory_xact_lock($3, $4) THEN false
            ELSE (set_config('synchronous_commit', 'off', true) || pg_notify($2, '')::text)
                 IS NOT NULL
       END
FROM u
"""
# After an acquire whose result never arrived (G6): drops this session's token locks that
# belong to no hold we know of. Args: $1 keys bigint[], $2 tokens bigint[] of our holds.
SQL_S_DROP_TOKEN_LOCKS = """
SELECT count(pg_advisory_unlock_shared(k)) FROM (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS k FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ShareLock'
      AND l.pid = pg_backend_pid()
    EXCEPT
    SELECT hashint8extended(t, k) FROM unnest($1::bigint[], $2::bigint[]) AS x(k, t)
) AS orphans
"""
# G9. Args: $1 key, $2 token. True if one session (or transaction) holds both the key and
# the token lock of ($2, $1), i.e. $2 is the token of the live hold.
SQL_S_VALIDATE = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks AS a JOIN pg_locks AS b ON b.pid = a.pid
    WHERE a.locktype = 'advisory' AND a.objsubid = 1 AND a.granted AND a.mode = 'ExclusiveLock'
      AND b.locktype = 'advisory' AND b.objsubid = 1 AND b.granted AND b.mode = 'ShareLock'
      AND a.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND b.database = a.database
      AND (a.classid::bigint << 32) | a.objid::bigint = $1
      AND (b.classid::bigint << 32) | b.objid::bigint = hashint8extended($2::bigint, $1))
"""
_X_TAKE = f"""{_NEXT}
SELECT l.ok, {_TOKEN_LOCKED.format(scope="xact_")} AS token FROM l"""
# xact_lock: args $1 key. Waits for the transaction lock, then takes a token (as
# SQL_S_ACQUIRE, with a transaction-scoped token lock).
SQL_X_LOCK = f"WITH l AS (SELECT true AS ok FROM pg_advisory_xact_lock($1)),{_X_TAKE}"
# xact_lock(wait=False): the same with pg_try_advisory_xact_lock.
SQL_X_TRY = f"WITH l AS (SELECT pg_try_advisory_xact_lock($1) AS ok),{_X_TAKE}"
# A token for a transaction lock already held. Args: $1 key.
SQL_X_TOKEN = f"WITH l AS (SELECT true AS ok),{_X_TAKE}"

# -- mode lease: statements --------------------------------------------------------------

# G1 + G2: args $1 name, $2 owner, $3 ttl (ms). Takes the row if absent or expired on the
# server's clock, unless the crash grace still runs. Returns (token, NULL) when granted,
# (NULL, seconds left) when busy or in the grace, no row if the row vanished meanwhile
# (try again), (NULL, NULL) when the range needs SQL_TOKEN_EPOCH (missing or used up) and
# (NULL, -1) when it needs SQL_L_TTL ($3 above its copy of the longest ttl) first. The
# token comes from the shared source (a value taken by a busy attempt is skipped, never
# reused). The lease table is unlogged: the commit waits for no WAL flush.
# G2 for a slow acquire: the token is taken *before* the upsert waits for the row's lock,
# so another holder may take and free the name meanwhile with a larger token. Rows are
# never deleted (release marks them free), and a free row is taken only by a larger token;
# otherwise the answer is (NULL, 0): busy for no time, try again with a fresh token.
SQL_L_ACQUIRE = f"""
WITH l AS (SELECT true AS ok),{_NEXT},
g AS (SELECT t.token, $3::float8 <= t.lease_ttl_ms AS ttl_ok,
             t.grace_until > clock_timestamp() AS in_grace, t.grace_until
      FROM t WHERE t.token <= t.lim),
ins AS (
    INSERT INTO asynclock_lease AS x (name, owner, token, expires_at)
    SELECT $1, $2, g.token, clock_timestamp() + $3::float8 * interval '1 millisecond'
    FROM g WHERE g.ttl_ok AND NOT g.in_grace
    ON CONFLICT (name) DO UPDATE
        SET owner = EXCLUDED.owner, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
        WHERE x.expires_at <= clock_timestamp() AND x.token < EXCLUDED.token
    RETURNING x.token
)
SELECT token, NULL::float8 AS left_s FROM ins
UNION ALL
SELECT NULL, greatest(0, extract(epoch FROM expires_at - clock_timestamp()))::float8
FROM asynclock_lease
WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM ins)
  AND EXISTS (SELECT 1 FROM g WHERE ttl_ok AND NOT in_grace)
UNION ALL
SELECT NULL, CASE WHEN NOT ttl_ok THEN -1
                  ELSE greatest(0.001, extract(epoch FROM grace_until - clock_timestamp())) END
FROM g WHERE NOT ttl_ok OR in_grace
UNION ALL
SELECT NULL, NULL WHERE NOT EXISTS (SELECT 1 FROM g)
"""
# G5/G7: every lease in one statement. Args: names bytea[], owners text[], tokens
# bigint[], ttls (ms) float8[]. Extends only live rows that are still ours; returns the
# 1-based positions extended.
SQL_L_EXTEND = """
UPDATE asynclock_lease AS l
SET expires_at = clock_timestamp() + x.ttl * interval '1 millisecond'
FROM unnest($1::bytea[], $2::text[], $3::bigint[], $4::float8[])
     WITH ORDINALITY AS x(name, owner, token, ttl, i)
WHERE l.name = x.name AND l.owner = x.owner AND l.token = x.token
  AND l.expires_at > clock_timestamp()
RETURNING x.i
"""
# G5: owner-checked release; args $1 name, $2 owner, $3 token or NULL, $4 channel, $5 and
# $6 the waiter key. Marks our row free (never deletes it: its token keeps a slow
# acquire's smaller token out, see SQL_L_ACQUIRE). Returns one row (was it still live?)
# if it was our row; notifies waiters if some backend announced one (as SQL_S_RELEASE).
# The commit does not wait for the WAL flush: if a crash undid it, the row would just expire.
SQL_L_RELEASE = """
WITH c AS (SELECT set_config('synchronous_commit', 'off', true)),
d AS (
    UPDATE asynclock_lease AS l SET expires_at = 'epoch'
    FROM (SELECT expires_at FROM asynclock_lease WHERE name = $1) AS was
    WHERE l.name = $1 AND l.owner = $2 AND ($3::bigint IS NULL OR l.token = $3)
      AND l.expires_at > 'epoch'
    RETURNING was.expires_at > clock_timestamp() AS live
)
SELECT d.live FROM c, d
LEFT JOIN LATERAL (SELECT pg_notify($4, '') WHERE NOT pg_try_advisory_xact_lock($5, $6)) AS n
    ON true
"""
# G9: args $1 name, $2 token.
SQL_L_VALIDATE = """
SELECT EXISTS (SELECT 1 FROM asynclock_lease
               WHERE name = $1 AND token = $2 AND expires_at > clock_timestamp())
"""

# -- holder and break_lock: statements -----------------------------------------------------

# Mode session (and xact_lock): the server pid holding key $1 in this database, or NULL,
# and our own pid. Owner, token and expiry of another session's hold are not on the server
# (the token lock is a hash of the token), so only the pid can be known.
_S_HOLDER_PID = """(SELECT l.pid FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND l.mode = 'ExclusiveLock'
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND (l.classid::bigint << 32) | l.objid::bigint = $1
     LIMIT 1)"""
SQL_S_HOLDER = f"SELECT {_S_HOLDER_PID} AS pid, pg_backend_pid() AS me"
# Operators' break in mode session, run on a connection of its own: end the session
# holding key $1 (a session lock can only be freed by its own session) unless it is $2 (our
# pinned session: that one unlocks instead). One statement, so it ends the session that
# holds the key now, never one that held it a moment ago. Args: $1 key, $2 our pid, $3 ms to
# wait for the session to exit (PostgreSQL >= 14; SQL_S_BREAK_NOWAIT before, without $3).
# Returns the ended pid, or no row when nobody else holds it. G2 holds: tokens come from the
# shared source, which only rises. Every other lock of that session ends with it.
SQL_S_BREAK = f"""
SELECT h.pid FROM (SELECT {_S_HOLDER_PID} AS pid) AS h
WHERE h.pid <> $2 AND pg_terminate_backend(h.pid, $3)
"""
SQL_S_BREAK_NOWAIT = f"""
SELECT h.pid FROM (SELECT {_S_HOLDER_PID} AS pid) AS h
WHERE h.pid <> $2 AND pg_terminate_backend(h.pid)
"""
# Mode lease: the live row of $1 name: owner, token and seconds left on the server's clock.
SQL_L_HOLDER = """
SELECT owner, token, greatest(0, extract(epoch FROM expires_at - clock_timestamp()))::float8
FROM asynclock_lease WHERE name = $1 AND expires_at > clock_timestamp()
"""
# Operators' break in mode lease: mark the live row of $1 free whoever owns it, notifying
# waiters as SQL_L_RELEASE does ($2 channel, $3 and $4 the waiter key). The broken owner's
# SQL_L_EXTEND matches no live row (refused); G2 holds (the row keeps its token).
# Returns the broken token, or no row if nothing live held it.
SQL_L_BREAK = """
WITH c AS (SELECT set_config('synchronous_commit', 'off', true)),
d AS (
    UPDATE asynclock_lease SET expires_at = 'epoch'
    WHERE name = $1 AND expires_at > clock_timestamp()
    RETURNING token
)
SELECT d.token FROM c, d
LEFT JOIN LATERAL (SELECT pg_notify($2, '') WHERE NOT pg_try_advisory_xact_lock($3, $4)) AS n
    ON true
"""

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
)


class PoolerDetected(BackendUnavailable):
    """Session advisory locks were refused: the URL goes through a transaction pooler."""


class PostgresDriver(Driver):
    """Session advisory locks (``mode="session"``) or a lease table (``mode="lease"``)."""

    def __init__(
        self,
        dsn: str,
        *,
        mode: str = "session",
        poll: float = 0.2,
        connect_timeout: float = 10.0,
        check_pooler: bool = True,
        display: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__()
        require_asyncio("the postgresql:// backend", "asyncpg")
        if mode not in MODES:
            raise ValueError(f"postgres mode must be 'session' or 'lease', got {mode!r}")
        self.dsn = dsn
        self.mode = mode
        self.poll = check_seconds(poll, "poll")
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self.check_pooler = check_pooler
        self.display = display or "postgresql://"
        self._password = password
        self._conn: asyncpg.Connection | None = None
        self._listen_conn: asyncpg.Connection | None = None
        # asyncio locks (asyncpg is asyncio-only): unlike anyio.Lock they do not yield
        # to the event loop when uncontended, which is most of a lock cycle's budget.
        self._io = asyncio.Lock()
        self._listen_io = asyncio.Lock()
        self._idle_set: str | None = None  # idle_session_timeout now set on the session
        self._closed = False
        self._pooled = False  # a transaction pooler sits in front (mode lease only)
        self._idle_timeout = True  # server has idle_session_timeout (PostgreSQL >= 14)
        # Mode session: which local owner holds (or is acquiring) each name on our
        # session. Advisory locks are re-entrant per session, so this is what stops two
        # tasks of this backend from both "getting" a name.
        self._holders: dict[str, str] = {}
        self._ttls: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        # When each hold would have expired had it been a lease: t_send + ttl of its last
        # acquire/extend. A hold the core stopped renewing (lost locally, never released)
        # is unlocked once this passes, so successors wait at most a ttl, as elsewhere.
        self._expires: dict[str, float] = {}
        # LISTEN bookkeeping: channel -> {name: number of watchers}.
        self._channels: dict[str, dict[str, int]] = {}
        # Channels LISTENed to, with their waiter key held, on the current listener.
        self._announced: set[str] = set()

    def __repr__(self) -> str:
        return f"<PostgresDriver {self.display} mode={self.mode}>"

    # -- connections -----------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        if self._password:
            text = text.replace(self._password, "***")
        return text

    def _unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        detail = self._scrub(str(exc) or type(exc).__name__)
        return BackendUnavailable(f"{self.display}: {what}: {detail}")

    async def _connect(self, *, statement_cache_size: int = 100) -> asyncpg.Connection:
        parts = urlsplit(self.dsn)
        settings = {}
        if "application_name" not in dict(parse_qsl(parts.query)):
            settings["application_name"] = "asynclock"
        try:
            conn: asyncpg.Connection = await asyncpg.connect(
                self.dsn,
                timeout=self.connect_timeout,
                statement_cache_size=statement_cache_size,
                server_settings=settings,
            )
        except asyncpg.exceptions.InvalidPasswordError as exc:
            raise self._unavailable(
                "authentication failed (check user and password)", exc
            ) from None
        except asyncpg.exceptions.InvalidAuthorizationSpecificationError as exc:
            raise self._unavailable("not authorised", exc) from None
        except asyncpg.exceptions.InvalidCatalogNameError as exc:
            raise self._unavailable("database does not exist", exc) from None
        except asyncpg.exceptions.TooManyConnectionsError as exc:
            raise self._no_slot(exc) from None
        except (TimeoutError, OSError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        except (asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        return conn

    def _no_slot(self, exc: BaseException) -> BackendUnavailable:
        """The server has no connection slot for us (SQLSTATE 53300): say that a backend
        needs two, and which limit was reached."""
        carries = "its lease statements" if self.mode == "lease" else "its locks"
        text = self._scrub(str(exc))
        named = re.search(r'for (role|database) "(.*)"', text)
        if named and named[1] == "role":
            role = _ident(named[2])
            fix = (
                f"role's CONNECTION LIMIT is reached: raise it to its other connections "
                f"+ 2 (ALTER ROLE {role} CONNECTION LIMIT n) or close some of them"
            )
        elif named:
            db = _ident(named[2])
            fix = (
                f"database's CONNECTION LIMIT is reached: raise it by 2 "
                f"(ALTER DATABASE {db} CONNECTION LIMIT n) or close other connections"
            )
        else:
            fix = (
                "server's max_connections is reached (the last "
                "superuser_reserved_connections slots are kept for superusers): raise "
                "max_connections (postgresql.conf, then restart) or close other connections"
            )
        return BackendUnavailable(
            f"{self.display}: no free connection slot ({text}). This backend needs two "
            f"connections to PostgreSQL: one pinned that carries {carries} and one for "
            f"LISTEN (release notifications). The {fix}."
        )

    async def open(self) -> None:
        require_asyncio(self.display, "asyncpg")
        self._closed = False
        conn = await self._open_main()
        self._conn = conn
        conn.add_termination_listener(self._on_main_terminated)

    async def _open_main(self) -> asyncpg.Connection:
        self._idle_set = None
        conn = await self._connect(statement_cache_size=0 if self._pooled else 100)
        try:
            if self.check_pooler and not self._pooled:
                pooled = await self._probe_pooler(conn)
                if pooled and self.mode == "session":
                    raise PoolerDetected(
                        f"{self.display}: this URL goes through a transaction-mode pooler "
                        f"(PgBouncer pool_mode=transaction, RDS Proxy, ...): {pooled}. "
                        "Session advisory locks would stay on a server session that the pooler "
                        "hands to other clients, so they could leak or be shared. Connect "
                        "directly to PostgreSQL or through a session-mode pool, or use the "
                        "lease table: add ?mode=lease to the URL."
                    )
                if pooled:
                    logger.info("%s: transaction pooler detected: %s", self.display, pooled)
                    self._pooled = True
                    await _close(conn)
                    await self._close_listener()
                    conn = await self._connect(statement_cache_size=0)
            version = int(await conn.fetchval("SELECT current_setting('server_version_num')"))
            self._idle_timeout = version >= 140000
            await ensure_schema(conn, mode=self.mode)
        except BaseException:
            await _close(conn)
            raise
        return conn

    async def _probe_pooler(self, conn: asyncpg.Connection) -> str | None:
        """Evidence of a transaction pooler, or None.

        Two client connections that are open at the same time must be two server sessions
        (different ``pg_backend_pid()``), and one connection must keep its pid. Behind a
        transaction pooler the second connection is usually handed the first one's idle
        server session (PgBouncer reuses the most recent one), and one client's pid can
        change between transactions. The heartbeat's ``pg_locks`` check by pid catches any
        case this probe misses, as a lost lease.
        """
        probe = await self._listener()
        try:
            first = await conn.fetchval("SELECT pg_backend_pid()")
            other = await probe.fetchval("SELECT pg_backend_pid()")
            again = await conn.fetchval("SELECT pg_backend_pid() AS again")
        except (
            asyncpg.exceptions.DuplicatePreparedStatementError,
            asyncpg.exceptions.InvalidSQLStatementNameError,
        ) as exc:
            return f"prepared statements vanished or collided between transactions ({exc})"
        if other == first:
            return f"two client connections shared one server session (pid {first})"
        if again != first:
            return f"one client connection moved from server pid {first} to {again}"
        return None

    async def _main(self) -> asyncpg.Connection:
        """The pinned connection; reconnect lazily after a loss (call with ``_io`` held)."""
        if self._closed:
            raise BackendUnavailable(f"{self.display}: the backend is closed")
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        if conn is not None:
            self._on_main_terminated(conn)
        conn = await self._open_main()
        self._conn = conn
        conn.add_termination_listener(self._on_main_terminated)
        return conn

    def _on_main_terminated(self, conn: Any) -> None:
        if conn is not self._conn and self._conn is not None:
            return
        self._conn = None
        self._lose_all("the PostgreSQL connection carrying the session lock was closed")

    def _lose_all(self, reason: str) -> None:
        held, self._holders = self._holders, {}
        self._ttls.clear()
        self._tokens.clear()
        self._expires.clear()
        for name, owner in held.items():
            self._notify_lost(name, owner, reason)

    def _broken(self, conn: asyncpg.Connection, exc: BaseException) -> None:
        """A statement failed in a way that leaves the session state unknown: drop it."""
        current = self._conn
        if self.mode != "session" or current is None or current is not conn:
            return
        self._conn = None
        self._lose_all(f"PostgreSQL session state unknown after an error: {exc!r}")
        current.terminate()

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        self._holders.clear()
        self._ttls.clear()
        self._tokens.clear()
        self._expires.clear()
        if conn is not None:
            await _close(conn)
        await self._close_listener()

    async def _raw_fetchval(self, sql: str, *args: Any) -> Any:
        """Run raw SQL on the pinned session (tests use it to sabotage a lock)."""
        async with self._io:
            return await (await self._main()).fetchval(sql, *args)

    # -- LISTEN ------------------------------------------------------------------------------

    async def _listener(self) -> asyncpg.Connection:
        conn = self._listen_conn
        if conn is None or conn.is_closed():
            conn = await self._connect(statement_cache_size=0)
            conn.add_termination_listener(self._on_listener_terminated)
            self._listen_conn = conn
            self._announced = set()
            for channel, names in list(self._channels.items()):
                await self._announce(conn, channel, next(iter(names)))
        return conn

    async def _announce(self, conn: asyncpg.Connection, channel: str, name: str) -> None:
        """LISTEN on ``channel``, then hold ``name``'s waiter key shared on the listener
        connection, so that releases of ``name`` NOTIFY (call with ``_listen_io`` held, or
        from :meth:`_listener`). The order matters: a release that sees the waiter key
        notifies a channel already listened to; one that does not see it unlocked before
        the key was taken, so the waiter's next try (right after :meth:`watch`) finds
        the lock free."""
        if channel in self._announced:
            return
        await conn.add_listener(channel, self._on_notify)
        high, low = waiter_key(name)  # ints: safe to inline (simple protocol, one trip)
        await conn.execute(f"SELECT pg_advisory_lock_shared({high}, {low})")
        self._announced.add(channel)

    async def _unannounce(self, conn: asyncpg.Connection, channel: str, name: str) -> None:
        if channel not in self._announced:
            return
        self._announced.discard(channel)
        high, low = waiter_key(name)
        await conn.execute(f"SELECT pg_advisory_unlock_shared({high}, {low})")
        await conn.remove_listener(channel, self._on_notify)

    def _on_listener_terminated(self, conn: Any) -> None:
        if conn is self._listen_conn:
            self._listen_conn = None
            self._announced = set()

    async def _close_listener(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        self._announced = set()
        if conn is not None:
            await _close(conn)

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for name in list(self._channels.get(channel, ())):
            self._wake(name)

    async def watch(self, name: str) -> bool:
        if self._pooled:
            return False  # LISTEN does not work through a transaction pooler: poll instead
        channel = notify_channel(name)
        names = self._channels.setdefault(channel, {})
        names[name] = names.get(name, 0) + 1
        if len(names) > 1 or names[name] > 1:
            return True
        try:
            async with self._listen_io:
                conn = await self._listener()
                if channel in self._channels:
                    await self._announce(conn, channel, name)
        except Exception as exc:  # polling still works; a waiter just hears later
            logger.warning("%s: LISTEN failed, waiters will poll: %r", self.display, exc)
        return True

    async def unwatch(self, name: str) -> None:
        channel = notify_channel(name)
        names = self._channels.get(channel)
        if names is None or name not in names:
            return
        names[name] -= 1
        if names[name] > 0:
            return
        del names[name]
        if names:
            return
        del self._channels[channel]
        conn = self._listen_conn
        if conn is None or conn.is_closed():
            return
        try:
            async with self._listen_io:
                if channel not in self._channels:
                    await self._unannounce(conn, channel, name)
        except Exception as exc:
            logger.debug("%s: UNLISTEN failed: %r", self.display, exc)

    # -- primitives ----------------------------------------------------------------------

    def _idle_change(self, *ttls: float) -> str | None:
        """The idle_session_timeout (ms) the session needs, if it differs from the
        current one: the longest ttl held, so the server ends a silent client's session
        (freeing its locks) no sooner than ttl after its last statement (G3)."""
        if not self._idle_timeout:
            return None
        longest = max((*self._ttls.values(), *ttls), default=0.0)
        wanted = str(math.ceil(longest * 1000))
        if wanted == self._idle_set:
            return None
        self._idle_set = wanted
        return wanted

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        # A token scope needs nothing here: one sequence (above the durable epoch) orders
        # every token of every name and mode, so a scope's tokens already rise (G2).
        if self.mode == "lease":
            return await self._lease_acquire(name, owner, ttl)
        # Under the connection lock: a release in flight on our session finishes first.
        async with self._io:
            for retry in (True, False):
                conn = await self._main()
                try:
                    return await self._session_acquire(conn, name, owner, ttl)
                except Exception as exc:
                    if not self._dead(conn, exc):
                        raise
                    # The session is gone (e.g. the server ended it at idle_session_timeout
                    # while we were waiting) and every lock with it: start a new one.
                    self._broken(conn, exc)
                    if not retry:
                        raise self._unavailable("acquire failed", exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _session_acquire(
        self, conn: asyncpg.Connection, name: str, owner: str, ttl: float
    ) -> int | Busy:
        if name in self._holders:
            # Another task of this backend holds it (advisory locks are re-entrant).
            left = self._expires.get(name, math.inf) - self.clock.now()
            if left > 0:
                return Busy(min(self.poll, left))
            await self._unlock_unrenewed(conn, [name])
        t_send = self.clock.now()
        # Reserve before asking: if we are interrupted the server may have granted the
        # lock, and release(name, owner, None) must know to unlock it (G6).
        self._holders[name] = owner
        key = lock_key(name)
        try:
            idle = self._idle_change(ttl)
            if idle is None:
                row = await conn.fetchrow(SQL_S_ACQUIRE_PLAIN, key)
            else:
                row = await conn.fetchrow(SQL_S_ACQUIRE, key, idle)
        except BaseException:
            self._idle_set = None  # unknown whether the setting stuck
            raise
        assert row is not None
        ok, token = row
        if not ok:
            del self._holders[name]
            return Busy(self.poll)
        for _ in range(_EPOCH_TRIES):
            if token is not None:
                break
            # Granted, but the token range is missing (first use, or emptied by crash
            # recovery) or used up. Interrupted here, the core's release(name, owner,
            # None) unlocks (G6).
            await _new_epoch(conn)
            token = await conn.fetchval(SQL_S_TOKEN, key, column=1)
        if token is None:
            raise _no_range(self.display)  # the core's release(name, owner, None) unlocks
        self._ttls[name] = ttl
        self._expires[name] = t_send + ttl
        self._tokens[name] = token = int(token)
        return token

    def _dead(self, conn: asyncpg.Connection, exc: BaseException) -> bool:
        """Did ``exc`` come from a connection that is gone (or unusable)?"""
        current = self._conn
        if current is None or conn is not current:
            return True
        closed: bool = current.is_closed()
        return closed or isinstance(
            exc, (*_CONNECTION_ERRORS, asyncpg.exceptions.InternalClientError)
        )

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        if self.mode == "lease":
            return await self._lease_extend(leases)
        async with self._io:
            conn = await self._main()
            keys = [lock_key(ref.name) for ref in leases]
            t_send = self.clock.now()
            unrenewed = [n for n, at in self._expires.items() if at <= t_send]
            if unrenewed:
                await self._unlock_unrenewed(conn, unrenewed)
            for ref in leases:  # lease.extend(ttl) may change a ttl: idle timeout follows
                if self._holders.get(ref.name) == ref.owner and ref.name in self._ttls:
                    self._ttls[ref.name] = ref.ttl
            try:
                idle = self._idle_change()
                if idle is None:
                    row = await conn.fetchrow(SQL_S_CHECK_PLAIN, keys)
                else:
                    row = await conn.fetchrow(SQL_S_CHECK, keys, idle)
            except BaseException as exc:
                self._idle_set = None
                if isinstance(exc, Exception) and self._dead(conn, exc):
                    self._broken(conn, exc)
                    raise self._unavailable("renewal failed", exc) from exc
                raise
        assert row is not None
        missing = set(row["missing"])
        results: list[ExtendResult] = []
        for ref, key in zip(leases, keys, strict=True):
            if self._holders.get(ref.name) != ref.owner or self._tokens.get(ref.name) != ref.token:
                results.append(Refused("this session no longer holds the lock"))
            elif key in missing:
                results.append(
                    Refused(
                        "the advisory lock is no longer held by this PostgreSQL session "
                        "(unlocked, session terminated, or a pooler moved the session)"
                    )
                )
            else:
                self._expires[ref.name] = t_send + ref.ttl
                results.append(True)
        return results

    async def _unlock_unrenewed(self, conn: asyncpg.Connection, names: list[str]) -> None:
        """Unlock holds whose ttl passed without a renewal (call with ``_io`` held)."""
        for name in names:
            try:
                await self._unlock(conn, name)
            except BaseException as exc:
                self._broken(conn, exc)
                raise
            self._forget(name)
            self._wake(name)

    async def _unlock(self, conn: asyncpg.Connection, name: str) -> bool | None:
        """Run SQL_S_RELEASE for our hold of ``name`` (call with ``_io`` held); if its token
        never reached us (an interrupted acquire), drop the token lock we cannot name."""
        key = lock_key(name)
        token = self._tokens.get(name)
        held: bool | None = await conn.fetchval(
            SQL_S_RELEASE, key, notify_channel(name), *waiter_key(name), token
        )
        if token is None:
            known = [(lock_key(n), t) for n, t in self._tokens.items()]
            await conn.fetchval(
                SQL_S_DROP_TOKEN_LOCKS, [k for k, _ in known], [t for _, t in known]
            )
        return held

    def _forget(self, name: str) -> None:
        self._holders.pop(name, None)
        self._ttls.pop(name, None)
        self._tokens.pop(name, None)
        self._expires.pop(name, None)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        if self.mode == "lease":
            return await self._lease_release(name, owner, token)
        async with self._io:
            # Not ours on this session: lost already, or another local task's hold.
            if self._holders.get(name) != owner:
                return False
            if token is not None and self._tokens.get(name) != token:
                return False
            conn = self._conn
            if conn is None or conn.is_closed():
                return False
            try:
                held = await self._unlock(conn, name)
            except BaseException as exc:
                # Unknown whether the unlock ran: ending the session is the only sure way
                # to free the key (and it frees it now, not at some later ttl).
                self._broken(conn, exc)
                raise
            self._forget(name)
        if held is not None:
            self._wake(name)
        return held is not None

    async def validate(self, name: str, token: int) -> bool:
        async with self._io:
            conn = await self._main()
            try:
                if self.mode == "lease":
                    ok = await conn.fetchval(SQL_L_VALIDATE, _name_bytes(name), token)
                else:
                    ok = await conn.fetchval(SQL_S_VALIDATE, lock_key(name), token)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("validate failed", exc) from exc
        return bool(ok)

    # -- mode lease ----------------------------------------------------------------------

    async def _lease_acquire(
        self, name: str, owner: str, ttl: float, *, raced: bool = False
    ) -> int | Busy:
        async with self._io:
            conn = await self._main()
            try:
                for _ in range(_EPOCH_TRIES):
                    rows = await conn.fetch(SQL_L_ACQUIRE, _name_bytes(name), owner, ttl * 1000.0)
                    if any(r["token"] is None and r["left_s"] is None for r in rows):
                        await _new_epoch(conn)  # the token range is missing or used up
                    elif any(r["left_s"] == -1 for r in rows):
                        # The longest lease ttl yet: on disk before such a lease exists.
                        await conn.execute(SQL_L_TTL, ttl * 1000.0)
                    else:
                        break
                else:
                    raise _no_range(self.display)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("acquire failed", exc) from exc
        if not rows:
            # The row vanished between the insert's conflict and our read: try again now.
            return Busy(0.0)
        row = rows[0]
        if row["token"] is None and row["left_s"] == 0 and not raced:
            # Free, but our token was taken before another holder's came and went while
            # we waited for the row (SQL_L_ACQUIRE): once more at once, with a fresh one.
            return await self._lease_acquire(name, owner, ttl, raced=True)
        if row["token"] is not None:
            return int(row["token"])
        left = float(row["left_s"])
        return Busy(min(left, self.poll) if self._pooled else left)

    async def _lease_extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        async with self._io:
            conn = await self._main()
            try:
                rows = await conn.fetch(
                    SQL_L_EXTEND,
                    [_name_bytes(r.name) for r in leases],
                    [r.owner for r in leases],
                    [r.token for r in leases],
                    [r.ttl * 1000.0 for r in leases],
                )
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("renewal failed", exc) from exc
        done = {int(r["i"]) for r in rows}
        return [
            True if i in done else Refused("lease row expired, deleted or taken over")
            for i in range(1, len(leases) + 1)
        ]

    async def _lease_release(self, name: str, owner: str, token: int | None) -> bool:
        async with self._io:
            conn = await self._main()
            try:
                live = await conn.fetchval(
                    SQL_L_RELEASE,
                    _name_bytes(name),
                    owner,
                    token,
                    notify_channel(name),
                    *waiter_key(name),
                )
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("release failed", exc) from exc
        if live is not None:
            self._wake(name)
        return bool(live)

    # -- holder and break_lock -----------------------------------------------------------

    async def holder(self, name: str) -> Holder | None:
        async with self._io:
            conn = await self._main()
            try:
                if self.mode == "lease":
                    row = await conn.fetchrow(SQL_L_HOLDER, _name_bytes(name))
                else:
                    row = await conn.fetchrow(SQL_S_HOLDER, lock_key(name))
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("holder failed", exc) from exc
        if self.mode == "lease":
            return None if row is None else Holder(name, row[0], int(row[1]), float(row[2]))
        assert row is not None
        pid, me = row
        if pid is None:
            return None
        owner = self._holders.get(name) if pid == me else None
        if owner is None:
            # Another session (or one of our transactions): only its pid is on the server.
            return Holder(name, None, None, None)
        return Holder(name, owner, self._tokens.get(name), None)

    async def break_lock(self, name: str) -> bool:
        if self.mode == "lease":
            async with self._io:
                conn = await self._main()
                try:
                    token = await conn.fetchval(
                        SQL_L_BREAK, _name_bytes(name), notify_channel(name), *waiter_key(name)
                    )
                except _CONNECTION_ERRORS as exc:
                    raise self._unavailable("break_lock failed", exc) from exc
            if token is not None:
                self._wake(name)
            return token is not None
        key = lock_key(name)
        async with self._io:
            conn = await self._main()
            try:
                pid, me = await conn.fetchrow(SQL_S_HOLDER, key)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("break_lock failed", exc) from exc
            if pid is None:
                return False
            if pid == me:  # our own session holds it: unlock it here, nothing else
                owner = self._holders.get(name)
                try:
                    await self._unlock(conn, name)
                except BaseException as exc:
                    self._broken(conn, exc)
                    raise
                self._forget(name)
                if owner is not None:
                    self._notify_lost(name, owner, "lock broken by break_lock()")
                self._wake(name)
                return True
        # Another session: end it from a connection of our own, so that waiting for it to
        # exit never holds up this backend's renewals on the pinned connection.
        other = await self._connect(statement_cache_size=0)
        try:
            if self._idle_timeout:
                ended = await other.fetchval(SQL_S_BREAK, key, me, _BREAK_WAIT_MS)
            else:
                ended = await other.fetchval(SQL_S_BREAK_NOWAIT, key, me)
        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
            raise self._unavailable(
                "break_lock failed: ending the holder's session needs its role or "
                "pg_signal_backend",
                exc,
            ) from None
        except _CONNECTION_ERRORS as exc:
            raise self._unavailable("break_lock failed", exc) from exc
        finally:
            await _close(other)
        if ended is None:
            return False  # released (or already ending) meanwhile
        self._wake(name)
        return True

    async def owner_of(self, name: str) -> tuple[str, int] | None:
        if self.mode != "lease":
            # A session advisory lock carries no owner, and its token lock is keyed by a
            # hash of (token, key): neither can be read back.
            return await super().owner_of(name)
        async with self._io:
            conn = await self._main()
            try:
                row = await conn.fetchrow(SQL_L_OWNER, _name_bytes(name))
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("owner lookup failed", exc) from exc
        return None if row is None else (str(row["owner"]), int(row["token"]))


# The live lease of mode lease (leader(), G9's read side). Args: $1 name. Returns its
# owner and token, or no row when the name is free.
SQL_L_OWNER = """
SELECT owner, token FROM asynclock_lease WHERE name = $1 AND expires_at > clock_timestamp()
"""


#: How long break_lock waits for the holder's session to exit (ms), so a successor's next
#: attempt finds the key free.
_BREAK_WAIT_MS = 5_000


def _ident(name: str) -> str:
    """``name`` as an SQL identifier in a hint (quoted unless plain lower case)."""
    if name.isidentifier() and name.isascii() and name == name.lower():
        return name
    return '"' + name.replace('"', '""') + '"'


async def _close(conn: asyncpg.Connection) -> None:
    try:
        with anyio.fail_after(2):
            await conn.close()
    except BaseException:
        conn.terminate()


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
    async with conn.transaction():
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


_OPTIONS = {"mode", "poll", "connect_timeout", "check_pooler"}


#: Query options asyncpg reads from a DSN itself (connection, TLS, authentication).
_ASYNCPG_OPTIONS = {
    "host",
    "port",
    "dbname",
    "database",
    "user",
    "password",
    "passfile",
    "service",
    "sslmode",
    "sslcert",
    "sslkey",
    "sslrootcert",
    "sslcrl",
    "sslpassword",
    "sslnegotiation",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "target_session_attrs",
    "krbsrvname",
    "gsslib",
}
#: Server settings a URL may set (asyncpg sends any other query option as one too, and
#: the server refuses unknown names only at open); a custom ``prefix.name`` is allowed.
_SERVER_SETTINGS = {
    "application_name",
    "search_path",
    "statement_timeout",
    "lock_timeout",
    "idle_in_transaction_session_timeout",
    "TimeZone",
    "timezone",
    "client_encoding",
    "options",
}
#: Settings asynclock manages on its own sessions.
_SET_BY_ASYNCLOCK = {
    "idle_session_timeout": "asynclock sets it to the longest ttl held (session mode), so "
    "a silent client's locks are freed",
}


def _check_query(query: list[tuple[str, str]], options: dict[str, Any]) -> None:
    """A configuration error is a ValueError at connect(), never "connect failed" at open."""
    allowed = _OPTIONS | _ASYNCPG_OPTIONS | _SERVER_SETTINGS
    for key, value in query:
        if key in _SET_BY_ASYNCLOCK:
            raise ValueError(
                f"postgresql:// URL option {key}={value} clashes with a setting asynclock "
                f"manages itself: {_SET_BY_ASYNCLOCK[key]}; remove it from the URL"
            )
        if key not in allowed and "." not in key.strip("."):
            raise ValueError(
                f"unknown postgresql:// URL option {key!r}; allowed: "
                f"{', '.join(sorted(allowed, key=str.lower))}, or a custom setting "
                "'prefix.name'"
            )
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown postgresql:// option(s) {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(sorted(_OPTIONS))}"
        )


def driver_from_url(url: str, **options: Any) -> PostgresDriver:
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(
            "invalid port in the postgresql:// URL; expected postgresql://user:password@"
            "host:5432/database"
        ) from None
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise ValueError(f"not a postgresql:// URL (scheme {parts.scheme!r})")
    password = unquote(parts.password) if parts.password else None
    query = parse_qsl(parts.query, keep_blank_values=True)
    _check_query(query, options)
    ours: dict[str, Any] = {k: v for k, v in query if k in _OPTIONS}
    rest = [(k, v) for k, v in query if k not in _OPTIONS]
    for key in ("poll", "connect_timeout"):
        if key in ours:
            ours[key] = check_seconds(ours[key], key)
    if "check_pooler" in ours:
        flag = str(ours["check_pooler"]).lower()
        if flag not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"check_pooler must be true or false, got {ours['check_pooler']!r}")
        ours["check_pooler"] = flag in ("true", "1", "yes", "on")
    ours.update(options)
    dsn = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(rest), ""))
    user = f"{quote(parts.username or '', safe='')}@" if parts.username else ""
    where = f"{host or 'localhost'}" + (f":{port}" if port else "")
    shown_query = f"?mode={ours['mode']}" if ours.get("mode") else ""
    display = f"postgresql://{user}{where}{parts.path}{shown_query}"
    return PostgresDriver(dsn, display=display, password=password, **ours)
