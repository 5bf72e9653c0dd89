"""The SQLite backend's schema and statements, each with what it takes, returns and
guarantees (the driver is :mod:`asynclock.backends.sqlite`)."""

from __future__ import annotations

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS asynclock_lease (
    name       TEXT PRIMARY KEY,
    owner      TEXT NOT NULL,
    token      INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    boot       TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS asynclock_waiter (
    name       TEXT NOT NULL,
    owner      TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    boot       TEXT NOT NULL,
    wake       TEXT,
    PRIMARY KEY (name, owner)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS asynclock_waiter_order ON asynclock_waiter (name, seq);
CREATE TABLE IF NOT EXISTS asynclock_scope (
    scope      TEXT PRIMARY KEY,
    token      INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS asynclock_record (
    name       TEXT PRIMARY KEY,
    token      INTEGER NOT NULL,
    payload    TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS asynclock_record_expiry ON asynclock_record (expires_at);
CREATE TABLE IF NOT EXISTS asynclock_permit (
    name       TEXT NOT NULL,
    slot       INTEGER NOT NULL,
    owner      TEXT NOT NULL,
    token      INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    boot       TEXT NOT NULL,
    lim        INTEGER NOT NULL,
    PRIMARY KEY (name, slot)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS asynclock_permit_place (
    name       TEXT NOT NULL,
    owner      TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    boot       TEXT NOT NULL,
    PRIMARY KEY (name, owner)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS asynclock_permit_place_order ON asynclock_permit_place (name, seq);
CREATE TABLE IF NOT EXISTS asynclock_rw (
    name       TEXT PRIMARY KEY,
    epoch      INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS asynclock_rw_hold (
    name       TEXT NOT NULL,
    owner      TEXT NOT NULL,
    mode       TEXT NOT NULL,
    token      INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    boot       TEXT NOT NULL,
    PRIMARY KEY (name, owner)
) WITHOUT ROWID;
"""

# G1/G2, the uncontended path in one statement: take :name if its row is free (released,
# expired, or from before a reboot) and nobody is queued for it; bump the token in place.
# Args: name, owner, expires_at, boot, now. Returns the new token, or no row if busy.
SQL_TRY = (
    "INSERT INTO asynclock_lease (name, owner, token, expires_at, boot) "
    "VALUES (?1, ?2, 1, ?3, ?4) "
    "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
    "token = asynclock_lease.token + 1, expires_at = excluded.expires_at, boot = excluded.boot "
    "WHERE (asynclock_lease.expires_at <= ?5 OR asynclock_lease.boot <> ?4) "
    "AND NOT EXISTS (SELECT 1 FROM asynclock_waiter w "
    "WHERE w.name = ?1 AND w.boot = ?4 AND w.expires_at > ?5) "
    "RETURNING token"
)
# G1/G2 inside a transaction that already checked the row is free and we are first in
# line. Args: name, owner, expires_at, boot. Returns the new token.
SQL_GRANT = (
    "INSERT INTO asynclock_lease (name, owner, token, expires_at, boot) "
    "VALUES (?1, ?2, 1, ?3, ?4) "
    "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, "
    "token = asynclock_lease.token + 1, expires_at = excluded.expires_at, boot = excluded.boot "
    "RETURNING token"
)
# G2 per token scope, in the grant's transaction right after SQL_GRANT: the scope's next
# token is above its counter and at least the name's new token (?2); the counter row is
# never deleted. Args: scope, the name's new token. Returns the token to grant.
SQL_SCOPE_NEXT = (
    "INSERT INTO asynclock_scope (scope, token) VALUES (?1, ?2) "
    "ON CONFLICT (scope) DO UPDATE SET token = max(asynclock_scope.token + 1, excluded.token) "
    "RETURNING token"
)
# The scope's token was above the name's: the lease row carries it (so the name's own
# counter stays above it too). Args: token, name.
SQL_SET_TOKEN = "UPDATE asynclock_lease SET token = ? WHERE name = ?"
# The live lease of :name (G1, G9): args name, boot, now. Returns owner, token, expires_at.
SQL_LIVE = (
    "SELECT owner, token, expires_at FROM asynclock_lease "
    "WHERE name = ? AND boot = ? AND expires_at > ?"
)
# Head of the fair queue, ignoring waiters that stopped asking: args name, boot, now.
# Returns owner, wake address.
SQL_HEAD = (
    "SELECT owner, wake FROM asynclock_waiter WHERE name = ? AND boot = ? AND expires_at > ? "
    "ORDER BY seq LIMIT 1"
)
# Queue or refresh a waiter, keeping its place: args name, owner, expires_at, boot, wake,
# place. The place is when the waiter began to wait (CLOCK_MONOTONIC, system-wide on
# Linux, as expiries are), not one more than the name's last: a backend's tasks wait in a
# line of their own and only its first has a row, so the next of them, queued when the
# first is served, must come before the waiters of other backends that arrived after it
# (first come, first served across processes).
SQL_QUEUE = (
    "INSERT INTO asynclock_waiter (name, owner, seq, expires_at, boot, wake) "
    "VALUES (?1, ?2, ?6, ?3, ?4, ?5) "
    "ON CONFLICT (name, owner) DO UPDATE SET expires_at = excluded.expires_at"
)
# How many live waiters are ahead of :owner, counted up to 8 (only "none" and "a few"
# matter: the poll delay; a full count grew with the number waiting): args name, boot,
# now, name, owner.
SQL_AHEAD = (
    "SELECT count(*) FROM (SELECT 1 FROM asynclock_waiter WHERE name = ? AND boot = ? "
    "AND expires_at > ? AND seq < (SELECT seq FROM asynclock_waiter WHERE name = ? "
    "AND owner = ?) LIMIT 8)"
)
# Keep every place of one backend (its wake address) in one statement, instead of each
# waiter rewriting its own row: args expires_at, wake address, boot.
SQL_KEEP_PLACES = "UPDATE asynclock_waiter SET expires_at = ? WHERE wake = ? AND boot = ?"
# G5/G7: extend only our own live lease: args expires_at, name, owner, token, boot, now.
SQL_EXTEND = (
    "UPDATE asynclock_lease SET expires_at = ? "
    "WHERE name = ? AND owner = ? AND token = ? AND boot = ? AND expires_at > ?"
)
# G5: owner-checked release; the row (and its token) stays. Token may be NULL after an
# interrupted acquire. Args: name, owner, token, boot, now. One row back if it was ours,
# carrying the wake address and owner of the first live waiter (or NULLs) to notify.
SQL_RELEASE = (
    "UPDATE asynclock_lease SET expires_at = 0 "
    "WHERE name = ?1 AND owner = ?2 AND (?3 IS NULL OR token = ?3) AND expires_at > 0 "
    "RETURNING (SELECT wake FROM asynclock_waiter WHERE name = ?1 AND boot = ?4 "
    "AND expires_at > ?5 ORDER BY seq LIMIT 1), "
    "(SELECT owner FROM asynclock_waiter WHERE name = ?1 AND boot = ?4 "
    "AND expires_at > ?5 ORDER BY seq LIMIT 1)"
)
SQL_FORGET_WAITER = "DELETE FROM asynclock_waiter WHERE name = ? AND owner = ?"
# A waiting backend whose wake address nobody listens on any more (its process is gone):
# args name, wake address.
SQL_FORGET_DEAD = "DELETE FROM asynclock_waiter WHERE name = ? AND wake = ?"
# Housekeeping: waiters that stopped asking. Args now, boot.
SQL_PRUNE_WAITERS = "DELETE FROM asynclock_waiter WHERE expires_at <= ? OR boot <> ?"
# Operator's break (G2 kept: the row and its token stay, only the expiry goes, so the
# broken holder's SQL_EXTEND matches no row and the next grant bumps the token).
# Args: name, boot, now. One row back if a live lease was ended, carrying the wake address
# and owner of the first live waiter (or NULLs) to notify.
SQL_BREAK = (
    "UPDATE asynclock_lease SET expires_at = 0 "
    "WHERE name = ?1 AND boot = ?2 AND expires_at > ?3 "
    "RETURNING (SELECT wake FROM asynclock_waiter WHERE name = ?1 AND boot = ?2 "
    "AND expires_at > ?3 ORDER BY seq LIMIT 1), "
    "(SELECT owner FROM asynclock_waiter WHERE name = ?1 AND boot = ?2 "
    "AND expires_at > ?3 ORDER BY seq LIMIT 1)"
)

# -- idempotency records (docs/idempotency.md) -------------------------------------------
#
# A record's expiry is wall-clock Unix time: it is kept for up to 30 days, across reboots
# (a lease's monotonic expiry is not).

# G8 for an idempotency record: store (token, payload) as the record of ?1 only while
# (?2 owner, ?3 token) is the live lease of ?1 and no record of a larger token exists, the
# check and the write in one statement. Args: name, owner, token, payload, expires_at
# (Unix time), boot, now (monotonic). Returns one row if stored, none if not.
SQL_RECORD_PUT = (
    "INSERT INTO asynclock_record (name, token, payload, expires_at) "
    "SELECT ?1, ?3, ?4, ?5 WHERE EXISTS (SELECT 1 FROM asynclock_lease "
    "WHERE name = ?1 AND owner = ?2 AND token = ?3 AND boot = ?6 AND expires_at > ?7) "
    "ON CONFLICT (name) DO UPDATE SET token = excluded.token, payload = excluded.payload, "
    "expires_at = excluded.expires_at WHERE asynclock_record.token <= excluded.token "
    "RETURNING token"
)
# The unexpired record of a name: args name, now (Unix time). Returns token, payload.
SQL_RECORD_GET = "SELECT token, payload FROM asynclock_record WHERE name = ? AND expires_at > ?"
# Delete the record of a name written by a token: args name, token.
SQL_RECORD_DELETE = "DELETE FROM asynclock_record WHERE name = ? AND token = ?"
# Housekeeping, in the transaction of each SQL_RECORD_PUT: expired records. Args: now (Unix).
SQL_RECORD_PRUNE = "DELETE FROM asynclock_record WHERE expires_at <= ?"
