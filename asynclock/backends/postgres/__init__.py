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

The statements are in :mod:`.sql`, the token source in :mod:`.tokens`, connecting and
LISTEN in :mod:`.connection`, the two drivers in :mod:`.session` and :mod:`.lease`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from ..._core.claims import MAX_LIMIT, Claim, ClaimBatch, Claims
from ..._core.validation import check_seconds
from .._common.options import Options
from .._common.urls import refuse_raw_brackets, url_scheme
from .claims import CLAIM_COLUMNS
from .connection import MODES, PoolerDetected, PostgresDriver
from .lease import LeaseDriver
from .session import SessionDriver
from .sql import EPOCH_SPAN as EPOCH_SPAN
from .sql import KEY_SQL
from .sql import SQL_S_ACQUIRE_PLAIN as SQL_S_ACQUIRE_PLAIN
from .sql import SQL_S_RELEASE as SQL_S_RELEASE
from .tokens import ensure_schema, lock_key, notify_channel, waiter_key, xact_lock

__all__ = (
    "CLAIM_COLUMNS",
    "KEY_SQL",
    "MAX_LIMIT",
    "Claim",
    "ClaimBatch",
    "Claims",
    "LeaseDriver",
    "PoolerDetected",
    "PostgresDriver",
    "SessionDriver",
    "driver_from_url",
    "ensure_schema",
    "lock_key",
    "notify_channel",
    "waiter_key",
    "xact_lock",
)

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


#: The options of postgresql:// (keywords: only asynclock's own).
OPTIONS = Options(
    "postgresql",
    _OPTIONS | _ASYNCPG_OPTIONS | _SERVER_SETTINGS,
    _OPTIONS,
    managed={
        key: f"a setting asynclock manages itself: {why}" for key, why in _SET_BY_ASYNCLOCK.items()
    },
    custom=lambda key: "." in key.strip("."),
    custom_text="or a custom setting 'prefix.name'",
)


def driver_from_url(url: str, **options: Any) -> PostgresDriver:
    refuse_raw_brackets(url, url_scheme(url), "set the PGPASSWORD environment variable")
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
    OPTIONS.check(query, options)
    ours: dict[str, Any] = {k: v for k, v in query if k in _OPTIONS}
    rest = [(k, v) for k, v in query if k not in _OPTIONS]
    for key in ("poll", "connect_timeout"):
        if key in ours:
            ours[key] = check_seconds(ours[key], key, text=True)
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
    mode = ours.pop("mode", "session")
    if mode not in MODES:
        raise ValueError(f"postgres mode must be 'session' or 'lease', got {mode!r}")
    cls = LeaseDriver if mode == "lease" else SessionDriver
    return cls(dsn, display=display, password=password, **ours)
