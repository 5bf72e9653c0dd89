"""The SQL of claims on PostgreSQL: the claim columns, identifier quoting, the claiming
index's name and every statement of one claims table (:class:`Statements`); the store that
runs them is ``claims.py``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from ..._core.claims import MAX_BACKOFF

__all__ = ("CLAIM_COLUMNS", "MAX_IDENTIFIER", "Statements", "check_sql", "index_name", "quote")

#: The columns a claims table needs besides its id, with the type each must have and the
#: definition ``ensure_columns()`` adds. Status: 'ready' -> 'claimed' -> 'done', back to
#: 'ready' (failed, retried later), or 'parked' (claimed ``max_attempts`` times: never again).
CLAIM_COLUMNS: Mapping[str, tuple[tuple[str, ...], str]] = {
    "status": (("text", "character varying"), "text NOT NULL DEFAULT 'ready'"),
    "claim_token": (("bigint",), "bigint"),
    "claimed_by": (("text", "character varying"), "text"),
    "claim_expires": (("timestamp with time zone",), "timestamptz"),
    "attempts": (("integer", "bigint", "smallint"), "integer NOT NULL DEFAULT 0"),
    "run_after": (("timestamp with time zone",), "timestamptz NOT NULL DEFAULT now()"),
    "last_error": (("text", "character varying"), "text"),
}

#: PostgreSQL truncates identifiers longer than this many bytes.
MAX_IDENTIFIER = 63


def quote(name: str, what: str) -> str:
    """``name`` as a quoted SQL identifier; refuse what PostgreSQL would truncate or reject."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if not name or "\x00" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER:
        raise ValueError(
            f"{what} must be a PostgreSQL identifier: 1 to {MAX_IDENTIFIER} bytes, no NUL (it is "
            f"quoted, so any other character is allowed), got {name!r}"
        )
    return '"' + name.replace('"', '""') + '"'


def index_name(qualified: str) -> str:
    """The claiming index's name for the table ``qualified`` (quoted, schema-qualified):
    the table name's readable start cut to whole characters, and 12 hex digits of a hash
    of the full qualified name, so two tables never share an index name (a shared name
    made ``CREATE INDEX IF NOT EXISTS`` skip the second table's index) and it always fits
    PostgreSQL's 63 bytes."""
    digest = hashlib.sha256(qualified.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    suffix = f"_{digest}_claims"
    table = qualified.rsplit('"."', 1)[-1].strip('"').replace('""', '"')
    room = MAX_IDENTIFIER - len(suffix.encode())
    start = table.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
    return quote(start + suffix, "index")


def check_sql(text: object, what: str) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str) or not text.strip():
        raise TypeError(f"{what} must be None or a non-empty SQL expression (str)")
    if ";" in text or "--" in text or "/*" in text:
        raise ValueError(
            f"{what} must be one SQL expression over the table's columns, without ';' or "
            f"comments, got {text!r}"
        )
    return text


class Statements:
    """The SQL of one claims table (identifiers quoted, the id's array type from the
    catalog). Each statement's header: its arguments, what it returns, the guarantee."""

    def __init__(
        self, table: str, id_col: str, id_type: str, where: str | None, order_by: str | None
    ) -> None:
        t, i = table, id_col
        cond = f"AND ({where})" if where else ""
        order = order_by or f"t.{i}"
        # Claim (G1 per row, G2): args $1 limit, $2 claimed_by, $3 ttl (ms), $4
        # max_attempts. One statement, one transaction: lock up to $1 claimable rows
        # (ready and due, or claimed with an expired claim), skipping rows another worker
        # has locked; give each a token from the shared source, drawn *after* its row lock,
        # so a reclaim's token is above the claim it replaces. A row already claimed
        # max_attempts times is parked instead. Returns one row: no_range (run
        # SQL_TOKEN_EPOCH, retry), used_up (some tokens passed the range: epoch, retry;
        # those rows were not claimed) and the claimed rows as records of the table.
        # The claimed rows are found again by their ids (``= ANY (ARRAY(...))``: an index
        # scan whatever the planner guesses), and the one-row range table is read with
        # ``LIMIT 1``. A plain join on ``k`` was planned from guesses (1,330 range rows;
        # ``LIMIT $1`` as a tenth of the table in the generic plan a prepared statement
        # settles on) as a hash of the WHOLE table: a sequential scan per claim, 2-6 ms
        # per batch of 50 on 10,000 rows, growing with the table (issue 38 item 5).
        self.claim = f"""
WITH r AS (SELECT base, lim FROM asynclock_token_range LIMIT 1),
p AS (
    SELECT t.{i} AS id FROM {t} AS t
    WHERE EXISTS (SELECT 1 FROM r)
      AND ((t.status = 'ready' AND t.run_after <= clock_timestamp())
        OR (t.status = 'claimed' AND t.claim_expires < clock_timestamp()))
      {cond}
    ORDER BY {order}
    LIMIT $1
    FOR UPDATE OF t SKIP LOCKED
),
k AS (SELECT p.id, r.base + nextval('asynclock_token_seq') AS token, r.lim FROM p, r),
u AS (
    UPDATE {t} AS t SET
        claim_token = k.token,
        status = CASE WHEN t.attempts >= $4 THEN 'parked' ELSE 'claimed' END,
        claimed_by = CASE WHEN t.attempts >= $4 THEN t.claimed_by ELSE $2 END,
        claim_expires = CASE WHEN t.attempts >= $4 THEN NULL
                        ELSE clock_timestamp() + $3::float8 * interval '1 millisecond' END,
        attempts = CASE WHEN t.attempts >= $4 THEN t.attempts ELSE t.attempts + 1 END,
        last_error = CASE WHEN t.attempts >= $4 AND t.status = 'claimed'
                     THEN 'parked: claimed ' || t.attempts || ' times; the last claim expired'
                     ELSE t.last_error END
    FROM k WHERE t.{i} = ANY (ARRAY(SELECT k.id FROM k WHERE k.token <= k.lim))
      AND t.{i} = k.id AND k.token <= k.lim
    RETURNING t AS row, t.status AS st, t.{i} AS id
)
SELECT NOT EXISTS (SELECT 1 FROM r) AS no_range,
       EXISTS (SELECT 1 FROM k WHERE k.token > k.lim) AS used_up,
       array(SELECT u.row FROM u WHERE u.st = 'claimed' ORDER BY u.id) AS rows,
       (SELECT count(*) FROM u WHERE u.st = 'parked') AS parked"""
        # Heartbeat (G7, G5): args $1 ids, $2 tokens, $3 ttls (ms), one per claimed row of
        # this worker. ONE statement renews them all: extends each row still carrying its
        # token and still claimed. Returns the 1-based positions extended; the rest are lost.
        self.heartbeat = f"""
UPDATE {t} AS t
SET claim_expires = clock_timestamp() + u.ttl_ms * interval '1 millisecond'
FROM unnest($1::{id_type}[], $2::bigint[], $3::float8[]) WITH ORDINALITY AS u(id, token, ttl_ms, i)
WHERE t.{i} = u.id AND t.claim_token = u.token AND t.status = 'claimed'
RETURNING u.i"""
        # Give back (G5): args $1 ids, $2 tokens, $3 errors (NULL: keep last_error). Rows
        # still carrying their token go back to 'ready' at once (attempts stay counted),
        # with the error their work ended with, if any. Returns nothing.
        self.give_back = f"""
UPDATE {t} AS t SET status = 'ready', claim_expires = NULL, run_after = clock_timestamp(),
    last_error = coalesce(u.error, t.last_error)
FROM unnest($1::{id_type}[], $2::bigint[], $3::text[]) AS u(id, token, error)
WHERE t.{i} = u.id AND t.claim_token = u.token AND t.status = 'claimed'"""
        # Fail (G8): args $1 id, $2 token, $3 error, $4 retry_in (s, NULL: backoff), $5
        # max_attempts. Only while the row carries $2 and is claimed: back to 'ready' after
        # the delay, or 'parked' once claimed max_attempts times. Returns the new status,
        # or no row: refused (then ``current`` reads the row's token).
        self.fail = f"""
UPDATE {t} AS t SET
        status = CASE WHEN t.attempts >= $5 THEN 'parked' ELSE 'ready' END,
        claim_expires = NULL,
        last_error = $3,
        run_after = clock_timestamp() + coalesce(
            $4::float8, least({MAX_BACKOFF}, power(2, greatest(t.attempts - 1, 0)))
        ) * interval '1 second'
WHERE t.{i} = $1 AND t.claim_token = $2 AND t.status = 'claimed'
RETURNING t.status"""
        # Current (after a refused completion only): args $1 id. The row's claim token.
        self.current = f"SELECT claim_token FROM {t} WHERE {i} = $1"
        # States (after a batch of completions): args $1 ids. Each row's id, claim token
        # and status: a row 'done' with our token is ours (a token is drawn once).
        self.states = (
            f"SELECT {i} AS id, claim_token, status FROM {t} WHERE {i} = ANY ($1::{id_type}[])"
        )
        self.table, self.id_col = t, i
        self._complete: dict[tuple[str, ...], str] = {}
        #: Sets of result columns already checked against this table (``check_results``).
        self.checked: set[tuple[str, ...]] = set()

    def complete(self, columns: tuple[str, ...]) -> str:
        """Complete (G8): args $1 id, $2 token, $3.. the result columns' values. One
        conditional UPDATE: only while the row carries $2 and is claimed, set status
        'done' and the results. Returns the status ('done'), or no row: refused. (Made once
        per set of result columns, named as the caller passed them: quoted here.)"""
        sql = self._complete.get(columns)
        if sql is None:
            sets = "".join(
                f", {quote(col, 'column')} = ${n}" for n, col in enumerate(columns, start=3)
            )
            t, i = self.table, self.id_col
            sql = self._complete[columns] = f"""
UPDATE {t} AS t SET status = 'done', claim_expires = NULL{sets}
WHERE t.{i} = $1 AND t.claim_token = $2 AND t.status = 'claimed'
RETURNING t.status"""
        return sql
