"""``postgresql://`` — locks in the PostgreSQL database you already run (asyncpg).

Two modes, chosen with ``?mode=`` in the URL:

``mode=session`` (default): **session advisory locks.** One pinned connection per backend
carries every lock it holds (``pg_try_advisory_lock``). The key is 64 bits of SHA-256 of
the name (:func:`lock_key`). The fencing token is bumped per name in the same statement
that takes the lock, and only when the lock was granted (see "Tokens" below). Each
heartbeat asks ``pg_locks``, in
one statement for every lease, whether *this backend pid* still holds each key, so a
dropped connection, a ``pg_terminate_backend`` or a pooler that moved the session is a
definite loss (G4, G5). Every statement sets ``idle_session_timeout`` to the longest ttl
the connection holds, so the server frees the locks of a client that went silent (hung,
partitioned, SIGSTOPped) at most ``ttl`` after its last statement, which is after that
client's own local deadline (G3). Needs a direct connection or a *session*-mode pooler;
a transaction-mode pooler is detected at open and refused.

``mode=lease``: **a lease table** (``asynclock_lease``: name, owner, token from the
sequence ``asynclock_lease_token``, ``expires_at`` on the server's clock,
``clock_timestamp()``). Acquire, extend and release are single conditional statements, so
it works through any pooler (with a transaction pooler: no LISTEN, bounded polling, and
asyncpg's statement cache off). Expiry trusts the server's wall clock not to jump.

Tokens (mode session and :func:`xact_lock`): the last token of a name lives in the
UNLOGGED table ``asynclock_token_live`` (no WAL, so the acquiring commit waits for no WAL
flush); the logged table ``asynclock_token`` holds a *ceiling* per name, and every token
ever handed out is <= its ceiling. Once a name's reservation is used up (every
:data:`TOKEN_RESERVE` acquisitions), or when its live row is missing, the acquiring
statement takes ``greatest(live, ceiling) + 1``, raises the ceiling to that +
``TOKEN_RESERVE - 1`` and commits synchronously (``synchronous_commit`` forced on for that
transaction). A ceiling is only written by synchronous commits, so any ceiling a
transaction can see is already on disk. PostgreSQL empties unlogged tables in crash
recovery, so after a crash every name restarts above its ceiling, above every token
handed out before the crash (G2) without any clock assumption. A clean restart keeps the
live rows. Mode lease keeps one WAL flush per acquire: its lease row must survive a crash
(G1), not only its token.

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
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from .._core.driver import Busy, Driver, ExtendResult, LeaseRef, Refused
from .._core.exceptions import BackendUnavailable, LockHeld
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

#: How many tokens one durable reservation covers (see "Tokens" in the module docstring).
TOKEN_RESERVE = 1000

# Tokens of mode session (and of xact_lock), per name. Never deleted (G2):
# ``asynclock_token.ceiling`` (logged, written only with a synchronous commit) is >= every
# token ever handed out for the name; ``asynclock_token_live.token`` (UNLOGGED: no WAL, so
# no WAL flush per acquisition; emptied by PostgreSQL's crash recovery) is the last token
# handed out since the last crash.
SCHEMA_SESSION = """
CREATE TABLE IF NOT EXISTS asynclock_token (name bytea PRIMARY KEY, ceiling bigint NOT NULL);
CREATE UNLOGGED TABLE IF NOT EXISTS asynclock_token_live (
    name    bytea PRIMARY KEY,
    token   bigint NOT NULL,
    ceiling bigint NOT NULL DEFAULT 0
);
ALTER TABLE asynclock_token_live ADD COLUMN IF NOT EXISTS ceiling bigint NOT NULL DEFAULT 0
"""
# Leases of mode lease; tokens from one sequence (strictly increasing for every name, G2).
SCHEMA_LEASE = """
CREATE SEQUENCE IF NOT EXISTS asynclock_lease_token;
CREATE TABLE IF NOT EXISTS asynclock_lease (
    name       bytea PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
)
"""

# -- mode session: statements ------------------------------------------------------------


def _bump(name: str) -> str:
    """The full token bump, after a CTE ``l`` that says whether we got the lock (``l.ok``);
    ``name`` is the parameter holding the name (bytea).

    A name's next token is live.token + 1. The live row keeps a copy of a ceiling that is
    already on disk (``live.ceiling <= asynclock_token.ceiling``), so while the next token
    stays <= that copy nothing but the UNLOGGED row is written: no WAL of ours, no flush.
    Otherwise, or when the live row is missing (first use, emptied by crash recovery, or a
    copy of 0 from an older version), the durable ceiling is read: if it covers the next
    token (missing row: ceiling + 1), the copy just catches up; if not, the ceiling moves
    to token + TOKEN_RESERVE - 1 in the same transaction, committed synchronously (forced
    on if the session has synchronous_commit = off). The ceiling read from the snapshot
    can only be older, so smaller, than the latest one: that reserves early and copies a
    smaller ceiling, never hands out more. ON CONFLICT reads the latest live row, so the
    statement snapshot predating the lock can't make two holders compute the same token.
    """
    return f"""
c AS (SELECT coalesce((SELECT ceiling FROM asynclock_token WHERE name = {name}), 0) AS ceiling
      FROM l WHERE l.ok),
live AS (
    INSERT INTO asynclock_token_live AS t (name, token, ceiling)
    SELECT {name}, c.ceiling + 1, c.ceiling + {TOKEN_RESERVE} FROM c
    ON CONFLICT (name) DO UPDATE SET
        token = t.token + 1,
        ceiling = CASE WHEN t.token + 1 <= EXCLUDED.token - 1 THEN EXCLUDED.token - 1
                       ELSE t.token + {TOKEN_RESERVE} END
    RETURNING t.token, t.ceiling
),
reserve AS (
    INSERT INTO asynclock_token AS r (name, ceiling)
    SELECT {name}, live.ceiling FROM live, c WHERE live.token > c.ceiling
    ON CONFLICT (name) DO UPDATE SET ceiling = greatest(r.ceiling, EXCLUDED.ceiling)
    RETURNING set_config('synchronous_commit',
                         CASE current_setting('synchronous_commit')
                         WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END,
                         true)
)
SELECT token FROM live
"""


# The common case of the bump: the next token is within the live row's copy of the
# ceiling, so only the UNLOGGED row changes (one index lookup, a HOT update, no WAL of
# ours). After the CTE ``l``; args $2 name bytea. Returns (ok, token): (false, NULL) busy,
# (true, token) granted, (true, NULL) granted but the token needs the full bump
# (SQL_S_BUMP). In READ COMMITTED a row updated after the snapshot is re-read at its
# latest version (EvalPlanQual) with the same ``l`` row, so the lock is tried only once.
_FAST_BUMP = """
u AS (
    UPDATE asynclock_token_live AS t SET token = t.token + 1
    FROM l WHERE l.ok AND t.name = $2 AND t.token < t.ceiling
    RETURNING t.token
)
SELECT l.ok, u.token FROM l LEFT JOIN u ON true
"""
# G1 + G2 in one round trip (two, once per TOKEN_RESERVE acquisitions of a name). Args: $1
# key bigint, $2 name bytea, $3 idle_session_timeout (ms, text). Takes the session lock if
# free and only then bumps the name's token.
SQL_S_ACQUIRE = f"""
WITH s AS (SELECT set_config('idle_session_timeout', $3, false)),
     l AS (SELECT pg_try_advisory_lock($1) AS ok FROM s),{_FAST_BUMP}"""
# The same when idle_session_timeout is already right (or the server predates it, < 14).
SQL_S_ACQUIRE_PLAIN = f"WITH l AS (SELECT pg_try_advisory_lock($1) AS ok),{_FAST_BUMP}"
# The full bump, with the lock already held. Args: $1 name bytea. Returns the token.
SQL_S_BUMP = f"WITH l AS (SELECT true AS ok),{_bump('$1')}"
# G4/G7 renewal of every lease in one round trip. Args: $1 keys bigint[], $2 idle ms (text).
# Returns one row: the keys of $1 that *this backend pid* no longer holds.
_MISSING = """array(SELECT k FROM unnest($1::bigint[]) AS k
             EXCEPT
             SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks AS l
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
               AND l.pid = pg_backend_pid()) AS missing"""
SQL_S_CHECK = f"SELECT set_config('idle_session_timeout', $2, false) AS idle, {_MISSING}"
# The same when idle_session_timeout needs no change. Args: $1 keys bigint[].
SQL_S_CHECK_PLAIN = f"SELECT {_MISSING}"
# G5 release. Args: $1 key, $2 channel, $3 and $4 the waiter key (:func:`waiter_key`).
# Unlocks our session's hold. Returns NULL if it was not held, false if it was and nobody
# waits, true if it was and waiters were notified. A waiting backend holds a shared lock on
# the waiter key (taken after its LISTEN, before its next try), so the exclusive probe
# fails exactly when someone may be waiting; only then does the statement NOTIFY, which
# costs a transaction id, a commit record and the notify queue's lock. That commit does
# not wait for the WAL flush: nothing here needs to survive a crash (the unlock is not
# transactional). Without a NOTIFY the statement writes nothing.
SQL_S_RELEASE = """
SELECT CASE WHEN NOT pg_advisory_unlock($1) THEN NULL
            WHEN pg_try_advisory_xact_lock($3, $4) THEN false
            ELSE (set_config('synchronous_commit', 'off', true) || pg_notify($2, '')::text)
                 IS NOT NULL
       END
"""
# G9. Args: $1 key, $2 name, $3 token. True if some session holds the key and $3 is the
# newest token issued for the name (tokens only move when the lock is granted).
SQL_S_VALIDATE = """
SELECT EXISTS (SELECT 1 FROM pg_locks AS l
               WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND (l.classid::bigint << 32) | l.objid::bigint = $1)
   AND EXISTS (SELECT 1 FROM asynclock_token_live WHERE name = $2 AND token = $3)
"""
# xact_lock: args $1 key, $2 name. Waits for the transaction lock, then bumps the token.
SQL_X_LOCK = f"WITH l AS (SELECT true AS ok FROM pg_advisory_xact_lock($1)),{_bump('$2')}"
# xact_lock(wait=False): the same with pg_try_advisory_xact_lock; no row when busy.
SQL_X_TRY = f"WITH l AS (SELECT pg_try_advisory_xact_lock($1) AS ok),{_bump('$2')}"

# -- mode lease: statements --------------------------------------------------------------

# G1 + G2: args $1 name, $2 owner, $3 ttl (ms). Takes the row if absent or expired on the
# server's clock. Returns (token, NULL) when granted, (NULL, seconds left) when busy.
SQL_L_ACQUIRE = """
WITH ins AS (
    INSERT INTO asynclock_lease AS l (name, owner, token, expires_at)
    VALUES ($1, $2, nextval('asynclock_lease_token'),
            clock_timestamp() + $3::float8 * interval '1 millisecond')
    ON CONFLICT (name) DO UPDATE
        SET owner = EXCLUDED.owner, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at <= clock_timestamp()
    RETURNING l.token
)
SELECT token, NULL::float8 AS left_s FROM ins
UNION ALL
SELECT NULL, greatest(0, extract(epoch FROM expires_at - clock_timestamp()))::float8
FROM asynclock_lease WHERE name = $1 AND NOT EXISTS (SELECT 1 FROM ins)
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
# G5: owner-checked delete; args $1 name, $2 owner, $3 token or NULL, $4 channel, $5 and
# $6 the waiter key. Returns one row (was it still live?) if it was our row; notifies
# waiters if some backend announced one (as SQL_S_RELEASE). The commit does not wait for
# the WAL flush: if a crash undid the delete, the row would just expire.
SQL_L_RELEASE = """
WITH c AS (SELECT set_config('synchronous_commit', 'off', true)),
d AS (
    DELETE FROM asynclock_lease
    WHERE name = $1 AND owner = $2 AND ($3::bigint IS NULL OR token = $3)
    RETURNING expires_at > clock_timestamp() AS live
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
        except (TimeoutError, OSError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        except (asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        return conn

    async def open(self) -> None:
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

    async def acquire(self, name: str, owner: str, ttl: float, *, queue: bool) -> int | Busy:
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
        name_bytes = _name_bytes(name)
        try:
            idle = self._idle_change(ttl)
            if idle is None:
                row = await conn.fetchrow(SQL_S_ACQUIRE_PLAIN, lock_key(name), name_bytes)
            else:
                row = await conn.fetchrow(SQL_S_ACQUIRE, lock_key(name), name_bytes, idle)
        except BaseException:
            self._idle_set = None  # unknown whether the setting stuck
            raise
        assert row is not None
        ok, token = row
        if not ok:
            del self._holders[name]
            return Busy(self.poll)
        if token is None:
            # Granted; the token needs a new reservation (or the live row is missing).
            # Interrupted here, the core's release(name, owner, None) unlocks (G6).
            token = await conn.fetchval(SQL_S_BUMP, name_bytes)
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
                await conn.fetchval(
                    SQL_S_RELEASE, lock_key(name), notify_channel(name), *waiter_key(name)
                )
            except BaseException as exc:
                self._broken(conn, exc)
                raise
            self._forget(name)
            self._wake(name)

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
                held = await conn.fetchval(
                    SQL_S_RELEASE, lock_key(name), notify_channel(name), *waiter_key(name)
                )
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
                    ok = await conn.fetchval(
                        SQL_S_VALIDATE, lock_key(name), _name_bytes(name), token
                    )
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("validate failed", exc) from exc
        return bool(ok)

    # -- mode lease ----------------------------------------------------------------------

    async def _lease_acquire(self, name: str, owner: str, ttl: float) -> int | Busy:
        async with self._io:
            conn = await self._main()
            try:
                row = await conn.fetchrow(SQL_L_ACQUIRE, _name_bytes(name), owner, ttl * 1000.0)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("acquire failed", exc) from exc
        if row is None:
            # The row vanished between the insert's conflict and our read: try again now.
            return Busy(0.0)
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


async def _close(conn: asyncpg.Connection) -> None:
    try:
        with anyio.fail_after(2):
            await conn.close()
    except BaseException:
        conn.terminate()


async def ensure_schema(conn: asyncpg.Connection, *, mode: str = "session") -> None:
    """Create the tables of ``mode`` ("session" or "lease") if missing.

    Idempotent and safe when many processes start at once: creation runs in one
    transaction behind a transaction advisory lock. When the tables exist this is one
    read-only query (no CREATE privilege needed).
    """
    tables, schema = (
        (["asynclock_token", "asynclock_token_live"], SCHEMA_SESSION)
        if mode == "session"
        else (["asynclock_lease"], SCHEMA_LEASE)
    )
    if await conn.fetchval(
        "SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest($1::text[]) t", tables
    ) and (
        mode != "session"
        # asynclock_token_live.ceiling (added later; an older table gets it here)
        or await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attname = 'ceiling'"
            " AND attrelid = to_regclass('asynclock_token_live') AND NOT attisdropped)"
        )
    ):
        return
    async with conn.transaction():
        await conn.execute(f"SELECT pg_advisory_xact_lock({_SCHEMA_KEY})")
        await conn.execute(schema)


async def xact_lock(conn: asyncpg.Connection, name: str, *, wait: bool = True) -> int:
    """Take ``name``'s lock for the rest of the caller's transaction; return its token.

    ``pg_advisory_xact_lock`` on :func:`lock_key` (the same key as session mode, so the
    two exclude each other) and the per-name counter bump, in one statement inside your
    transaction. The lock is released at commit or rollback; the token counts on from
    the same counter as session mode, so fence your writes with it. Pooler-safe.

    ``wait=False`` raises :class:`~asynclock.LockHeld` instead of waiting. Call
    :func:`ensure_schema` once beforehand (or let a session-mode backend create it)::

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
    try:
        token = await conn.fetchval(
            SQL_X_LOCK if wait else SQL_X_TRY, lock_key(name), _name_bytes(name)
        )
    except asyncpg.exceptions.UndefinedTableError:
        raise BackendUnavailable(
            "table asynclock_token does not exist: run `await ensure_schema(conn)` once "
            "(or open a session-mode backend on this database)"
        ) from None
    if token is None:
        raise LockHeld(name)
    return int(token)


_OPTIONS = {"mode", "poll", "connect_timeout", "check_pooler"}


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
