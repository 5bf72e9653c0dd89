"""Every SQL statement of the ``postgresql://`` backend, each with a header: its arguments,
what it returns and the guarantee it implements (the reasoning is in
docs/backends/postgres.md). The crash and G2 tests prove these texts: change them only
with a test."""

from __future__ import annotations

#: The same key as :func:`lock_key`, computed in SQL from a text parameter ``$1``.
KEY_SQL = "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint"

#: Key of the transaction advisory lock that serialises schema creation.
_SCHEMA_KEY = 0x6173796E636C6F63  # "asynclock" in ASCII, first 8 bytes

# -- schema ------------------------------------------------------------------------------

#: Tokens of one epoch lie in ``[epoch * EPOCH_SPAN, (epoch + 1) * EPOCH_SPAN)`` (2**40).
EPOCH_SPAN = 1 << 40

# The token source of every mode and of xact_lock (G2). The sequence and the range row
# are UNLOGGED (no WAL per token; crash recovery empties them); the logged epoch table
# backs every ``lim``. The range row also carries mode lease's crash grace (G1). Never
# delete these. Why: "Tokens across crashes" in docs/backends/postgres.md.
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
# max + 1 with a forced synchronous commit and creates the range row (or raises its
# ``lim``) to that epoch's end. Returns (base, lim, sync), or no row if a concurrent
# caller appended the same epoch first: run it again. G1 for mode lease: a new range row
# starts a grace of the longest lease ttl ever granted. Why: "Tokens across crashes" and
# "Leases across crashes" in docs/backends/postgres.md.
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
# first, then unlocks. Returns NULL if the lock was not held, false if it was and nobody
# waits, true if it was and waiters were notified. It NOTIFYs (a transaction id and a
# commit record, no flush) only when the waiter-key probe finds a waiter; else it writes
# nothing. Why: "Mode session" in docs/backends/postgres.md.
SQL_S_RELEASE = """
WITH u AS (SELECT pg_advisory_unlock_shared(hashint8extended($5::bigint, $1)) AS token_lock)
SELECT CASE WHEN NOT pg_advisory_unlock($1) THEN NULL
            WHEN pg_try_advisory_xact_lock($3, $4) THEN false
            ELSE (set_config('synchronous_commit', 'off', true) || pg_notify($2, '')::text)
                 IS NOT NULL
       END
FROM u
"""
# Release with no new lock table entry (the table is full). Args: $1 key, $2 the hold's
# token (NULL: its token lock is left to SQL_S_DROP_TOKEN_LOCKS; the strict functions then
# do nothing). Returns whether the key was held (false comes with a WARNING, not an error).
SQL_S_UNLOCK_BARE = """
WITH u AS (SELECT pg_advisory_unlock_shared(hashint8extended($2::bigint, $1)) AS token_lock)
SELECT pg_advisory_unlock($1) FROM u
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
def _live_hold(key: str, token: str) -> str:
    """A query with a row if one session holds the advisory lock of ``key`` and the token
    lock of (``token``, ``key``): ``token`` is the token of the live hold of ``key``."""
    return f"""
    SELECT 1 FROM pg_locks AS a JOIN pg_locks AS b ON b.pid = a.pid
    WHERE a.locktype = 'advisory' AND a.objsubid = 1 AND a.granted AND a.mode = 'ExclusiveLock'
      AND b.locktype = 'advisory' AND b.objsubid = 1 AND b.granted AND b.mode = 'ShareLock'
      AND a.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND b.database = a.database
      AND (a.classid::bigint << 32) | a.objid::bigint = {key}
      AND (b.classid::bigint << 32) | b.objid::bigint = hashint8extended({token}::bigint, {key})"""


SQL_S_VALIDATE = f"""
SELECT EXISTS ({_live_hold("$1", "$2")})
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
# (try again), (NULL, NULL) when the range needs SQL_TOKEN_EPOCH and (NULL, -1) when it
# needs SQL_L_TTL first. A free row is taken only by a larger token (rows are never
# deleted), else (NULL, 0): try again with a fresh token. Why: "Mode lease" in the docs.
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
# SQL_L_RELEASE for many leases in one statement (many blocks exiting at once). Args:
# arrays $1 names, $2 owners, $3 tokens (NULL: any), $4 channels, $5 and $6 waiter keys.
# Returns (i, live) for each released lease, i its 1-based place in the arrays; a lease not
# released has no row. One release per name per batch (two on one row would both match it,
# and RETURNING would name one of them). Each row released takes its waiter key's advisory
# lock until commit when nobody waits (the lock table is shared: batches stay small).
SQL_L_RELEASE_MANY = """
WITH c AS (SELECT set_config('synchronous_commit', 'off', true)),
r AS (
    SELECT * FROM unnest($1::bytea[], $2::text[], $3::bigint[], $4::text[], $5::int[],
                         $6::int[]) WITH ORDINALITY AS r(name, owner, token, channel, k1, k2, i)
),
d AS (
    UPDATE asynclock_lease AS l SET expires_at = 'epoch'
    FROM (SELECT r.*, a.expires_at AS was FROM r JOIN asynclock_lease AS a ON a.name = r.name)
         AS w
    WHERE l.name = w.name AND l.owner = w.owner AND (w.token IS NULL OR l.token = w.token)
      AND l.expires_at > 'epoch'
    RETURNING w.i, w.was > clock_timestamp() AS live, w.channel, w.k1, w.k2
)
SELECT d.i, d.live FROM c, d
LEFT JOIN LATERAL (SELECT pg_notify(d.channel, '') WHERE NOT pg_try_advisory_xact_lock(d.k1, d.k2))
    AS n ON true
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
# Operators' view of another session's hold, held by pid $1: who it is (pg_stat_activity).
SQL_S_HOLDER_SESSION = """
SELECT a.application_name, host(a.client_addr) AS client, a.backend_start, NULL AS token
FROM (SELECT 1) AS one LEFT JOIN pg_stat_activity AS a ON a.pid = $1
"""
# The same for key $1 held by pid $2, with its token: found among the last $3 tokens handed
# out as the one whose token lock (hashint8extended(token, key)) that pid holds; NULL if
# not among them. Needs the right to read asynclock's token tables.
SQL_S_HOLDER_WHO = """
SELECT a.application_name, host(a.client_addr) AS client, a.backend_start,
       (SELECT t.token
        FROM generate_series(
                 greatest(1, (SELECT r.base + s.last_value
                              FROM asynclock_token_range AS r, asynclock_token_seq AS s) - $3),
                 (SELECT r.base + s.last_value
                  FROM asynclock_token_range AS r, asynclock_token_seq AS s)) AS t(token)
        WHERE hashint8extended(t.token, $1) IN (
            SELECT (l.classid::bigint << 32) | l.objid::bigint FROM pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
              AND l.mode = 'ShareLock' AND l.pid = $2)
        ORDER BY t.token DESC LIMIT 1) AS token
FROM (SELECT 1) AS one LEFT JOIN pg_stat_activity AS a ON a.pid = $2
"""
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

# -- idempotency records (docs/idempotency.md) -----------------------------------------------

# One record per lock name, beside the leases. A logged table: a stored result must
# survive a crash (the lease tables need not). Created on first use (SQL_RECORD_SCHEMA),
# so a deployment that never uses idempotency keys needs no new table.
SQL_RECORD_EXISTS = "SELECT to_regclass('asynclock_record') IS NOT NULL"
SQL_RECORD_SCHEMA = f"""
SELECT pg_advisory_xact_lock({_SCHEMA_KEY});
CREATE TABLE IF NOT EXISTS asynclock_record (
    name       bytea PRIMARY KEY,
    token      bigint NOT NULL,
    payload    text NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS asynclock_record_expiry ON asynclock_record (expires_at)
"""
# The store of an idempotency record, after a CTE ``live`` (one row while the writer's
# lease is the live one): ($1 name, $3 token, $4 payload, $5 keep ms). A record of a
# larger token is never overwritten. Returns one row if stored, none if not. Expired
# records are deleted on the way (at most 100 per store).
_RECORD_STORE = """
gone AS (
    DELETE FROM asynclock_record WHERE name IN (
        SELECT name FROM asynclock_record WHERE expires_at <= clock_timestamp() LIMIT 100)
)
INSERT INTO asynclock_record AS r (name, token, payload, expires_at)
SELECT $1, $3, $4, clock_timestamp() + $5::float8 * interval '1 millisecond' FROM live
ON CONFLICT (name) DO UPDATE
    SET token = EXCLUDED.token, payload = EXCLUDED.payload, expires_at = EXCLUDED.expires_at
    WHERE r.token <= EXCLUDED.token
RETURNING r.token
"""
# G8, mode lease: store the record only while ($2 owner, $3 token) is the live lease row of
# $1 name, the check and the write in one statement; the row is locked FOR SHARE so no
# acquire, extend or break changes it before the write commits.
SQL_L_RECORD_PUT = f"""
WITH live AS (
    SELECT 1 FROM asynclock_lease
    WHERE name = $1 AND owner = $2 AND token = $3 AND expires_at > clock_timestamp()
    FOR SHARE
),{_RECORD_STORE}"""
# G8, mode session: store the record only while some session holds the advisory lock of
# $2 key and the token lock of ($3 token, $2 key) — the test of SQL_S_VALIDATE, in the
# same statement as the write. A later holder's write of the same row waits for this one
# to commit and then overwrites it (its token is larger).
SQL_S_RECORD_PUT = f"""
WITH live AS ({_live_hold("$2", "$3")}
    LIMIT 1
),{_RECORD_STORE}"""
# The unexpired record of $1 name: token, payload.
SQL_RECORD_GET = """
SELECT token, payload FROM asynclock_record WHERE name = $1 AND expires_at > clock_timestamp()
"""
# Delete the record of $1 name if $2 token wrote it. Returns the token, or no row.
SQL_RECORD_DELETE = "DELETE FROM asynclock_record WHERE name = $1 AND token = $2 RETURNING token"
