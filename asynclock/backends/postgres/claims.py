"""Claims on PostgreSQL: the statements behind ``backend.claims(table, ...)`` (the life of
a claim is the core's: ``asynclock/_core/claims.py``).

Rows of your own table are claimed with ``FOR UPDATE SKIP LOCKED``, each with a token from
the backend's token source drawn after its row lock; every later write (renewal,
completion, failure, give-back) is one conditional statement on the row's claim token
(G5, G8). As the claimed rows' :class:`~asynclock._core.driver.Keeper`, a store renews
every claimed row of its table in one statement per renewal call, and gives one row back
for ``lease.release()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.claim_store import ClaimedRow, Finish
from ..._core.claims import MAX_BACKOFF, MAX_LIMIT
from ..._core.driver import ExtendResult, LeaseRef, Refused
from .connection import _CONNECTION_ERRORS
from .tokens import _EPOCH_TRIES, _new_epoch, _no_range

if TYPE_CHECKING:
    from .connection import PostgresDriver

__all__ = ("CLAIM_COLUMNS", "MAX_LIMIT", "PostgresClaimStore", "index_name")

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


class PostgresClaimStore:
    """One claims table: its statements, and the keeper of its claimed rows' leases.

    Made by the driver (one per table, id column and claim conditions, shared by every
    ``backend.claims()`` object of them, so a renewal call carries all of a table's rows).
    """

    def __init__(
        self,
        driver: PostgresDriver,
        table: str,
        *,
        where: str | None,
        order_by: str | None,
        id_column: str,
        schema: str | None,
    ) -> None:
        self._driver = driver
        self.display = driver.display
        qualified = quote(table, "table")
        if schema is not None:
            qualified = f"{quote(schema, 'schema')}.{qualified}"
        self.table = table if schema is None else f"{schema}.{table}"
        self._qualified = qualified
        self.id_column = id_column
        self._id = quote(id_column, "id_column")
        self._where = check_sql(where, "where")
        self._order_by = check_sql(order_by, "order_by")
        self._sql: Statements | None = None
        self._columns: dict[str, str] = {}
        #: The id of each claimed row renewed here, by its lease owner.
        self._row_ids: dict[str, Any] = {}
        #: One renewal statement carries at most this many rows.
        self.renew_chunk: int | None = 5000
        #: Nobody waits for a claimed row (take() never waits).
        self.wakes_waiters = True
        #: Claims are not acquired through the core's acquire (see Holds.adopt).
        self.queues_locally = False

    def __repr__(self) -> str:
        return f"<PostgresClaimStore {self.table!r}>"

    def recheck(self) -> None:
        """Read the table's columns again at the next use (its schema may have changed)."""
        self._sql = None

    # -- schema --------------------------------------------------------------------------------

    async def create_table(self) -> None:
        cols = ",\n    ".join(f"{name} {spec}" for name, (_, spec) in CLAIM_COLUMNS.items())
        await self._ddl(
            "create_table",
            f"""CREATE TABLE IF NOT EXISTS {self._qualified} (
    {self._id} bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    payload jsonb,
    result jsonb,
    {cols}
)""",
        )

    async def ensure_columns(self) -> None:
        await self._read_columns()
        adds = ", ".join(
            f"ADD COLUMN IF NOT EXISTS {name} {spec}" for name, (_, spec) in CLAIM_COLUMNS.items()
        )
        await self._ddl("ensure_columns", f"ALTER TABLE {self._qualified} {adds}")

    async def _ddl(self, what: str, sql: str) -> None:
        """``sql`` and the claiming index (claimable rows in id order without scanning
        finished ones) in one transaction: all or nothing."""
        index = (
            f"CREATE INDEX IF NOT EXISTS {index_name(self._qualified)} ON {self._qualified} "
            f"({self._id}) WHERE status IN ('ready', 'claimed')"
        )
        driver = self._driver
        async with driver._io:
            conn = await driver._main()
            try:
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute(index)
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable(f"claims {what} failed", exc) from exc
            except asyncpg.PostgresError as exc:
                raise ValueError(f"claims on {self.table!r}: {what} failed: {exc}") from None
        self._sql = None

    async def _read_columns(self) -> dict[str, str]:
        """The table's columns and their types; ValueError for a missing table or id."""
        rows = await self._driver._run(
            "claims: reading the table's columns",
            "fetch",
            """SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type
               FROM pg_attribute AS a
               WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped""",
            self._qualified,
        )
        if not rows:
            raise ValueError(
                f"claims: table {self.table!r} does not exist (or is not visible on the "
                "search_path); create it, or call `await claims.create_table()`"
            )
        columns = {r["attname"]: r["type"] for r in rows}
        if self.id_column not in columns:
            raise ValueError(
                f"claims: table {self.table!r} has no id column {self.id_column!r}; pass "
                f"id_column= (a unique column), one of: {', '.join(sorted(columns))}"
            )
        return columns

    async def _resolve(self) -> Statements:
        """Check the table and its columns once; build its statements."""
        if self._sql is not None:
            return self._sql
        columns = self._columns = await self._read_columns()
        missing = [name for name in CLAIM_COLUMNS if name not in columns]
        if missing:
            raise ValueError(
                f"claims: table {self.table!r} lacks the claim columns {', '.join(missing)}; "
                "add them with `await claims.ensure_columns()` (see docs/claims.md)"
            )
        for name, (types, spec) in CLAIM_COLUMNS.items():
            found = columns[name].split("(")[0]
            if found not in types:
                raise ValueError(
                    f"claims: column {self.table}.{name} is {columns[name]}; it must be "
                    f"{' or '.join(types)} ({spec.split()[0]} in docs/claims.md)"
                )
        self._sql = Statements(
            self._qualified, self._id, columns[self.id_column], self._where, self._order_by
        )
        return self._sql

    # -- claiming ------------------------------------------------------------------------------

    async def claim(
        self, limit: int, claimed_by: str, ttl: float, max_attempts: int
    ) -> list[ClaimedRow]:
        sql = self._sql or await self._resolve()
        for _ in range(_EPOCH_TRIES):
            row = await self._claim_statement(sql, limit, claimed_by, ttl, max_attempts)
            claimed = [self._claimed(r) for r in row["rows"]]
            if claimed or not (row["no_range"] or row["used_up"]):
                return claimed
        raise _no_range(f"claims on {self.table!r}")

    def _claimed(self, record: Any) -> ClaimedRow:
        values = dict(record.items())
        return ClaimedRow(values[self.id_column], int(values["claim_token"]), values)

    async def _claim_statement(
        self, sql: Statements, limit: int, claimed_by: str, ttl: float, max_attempts: int
    ) -> Any:
        driver = self._driver
        try:
            row = await driver._run(
                "claim failed", "fetchrow", sql.claim, limit, claimed_by, ttl * 1000.0, max_attempts
            )
        except asyncpg.PostgresError as exc:
            raise ValueError(
                f"claims on {self.table!r}: the claim statement failed ({exc}); check "
                "where= and order_by="
            ) from None
        if row["no_range"] or row["used_up"]:
            async with driver._io:  # first token, or after a crash (G2); then claim again
                try:
                    await _new_epoch(await driver._main())
                except _CONNECTION_ERRORS as exc:
                    raise driver._unavailable("claim failed", exc) from exc
        return row

    def track(self, owner: str, row_id: Any) -> None:
        self._row_ids[owner] = row_id

    def untrack(self, owner: str) -> None:
        self._row_ids.pop(owner, None)

    # -- the keeper: renewal and release ------------------------------------------------------

    async def extend(self, leases: Sequence[LeaseRef]) -> list[ExtendResult]:
        """Renew these claimed rows in one statement."""
        sql = await self._resolve()
        # A claim finished while this call was on its way is no longer ours to renew (the
        # session skips its answer): it goes out as a NULL id, which matches no row.
        ids = [self._row_ids.get(ref.owner) for ref in leases]
        rows = await self._driver._run(
            "claim renewal failed",
            "fetch",
            sql.heartbeat,
            ids,
            [ref.token for ref in leases],
            [ref.ttl * 1000.0 for ref in leases],
            first=True,
        )
        done = {int(r["i"]) for r in rows}
        return [
            True if n in done else Refused("the row was reclaimed, completed or given back")
            for n in range(1, len(leases) + 1)
        ]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """``lease.release()`` of a claim: give its row back (owner-checked by token)."""
        row_id = self._row_ids.pop(owner, None)
        if row_id is None or token is None:
            return False
        sql = await self._resolve()
        status = await self._driver._run(
            "give back failed",
            "execute",
            sql.give_back,
            [row_id],
            [token],
            [None],
        )
        return str(status).endswith(" 1")

    async def give_back(self, rows: Sequence[tuple[Any, int, str | None]]) -> None:
        sql = await self._resolve()
        await self._driver._run(
            "give back failed",
            "execute",
            sql.give_back,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
        )

    # -- finishing -----------------------------------------------------------------------------

    def knows(self, results: Mapping[str, Any]) -> bool:
        """These result columns were checked against the table as resolved."""
        return self._sql is not None and tuple(results) in self._sql.checked

    async def check_results(self, results: Mapping[str, Any]) -> None:
        if self.knows(results):
            return
        sql = await self._resolve()
        for col in results:
            if col in CLAIM_COLUMNS or col == self.id_column:
                raise ValueError(
                    f"complete() cannot set {col!r}: the claim columns and the id are "
                    "asynclock's; pass your own result columns"
                )
            if col not in self._columns:
                raise ValueError(
                    f"complete(): table {self.table!r} has no column {col!r}; its columns: "
                    f"{', '.join(sorted(self._columns))}"
                )
        sql.checked.add(tuple(results))

    async def complete(self, row_id: Any, token: int, results: Mapping[str, Any]) -> Finish:
        sql = self._sql or await self._resolve()
        statement = sql.complete(tuple(results))
        return await self._finish(
            sql, statement, "claim complete failed", row_id, token, *results.values()
        )

    async def complete_many(
        self, columns: tuple[str, ...], rows: Sequence[tuple[Any, int, Sequence[Any]]]
    ) -> list[Finish]:
        # complete()'s own statement per row, pipelined and atomic (asyncpg's executemany:
        # one transaction, any error writes nothing), then one read of the rows' states:
        # whatever the columns' types (an array column cannot ride an unnest).
        sql = self._sql or await self._resolve()
        run = self._driver._run
        what = "claim complete failed"
        await run(what, "executemany", sql.complete(columns), [(r[0], r[1], *r[2]) for r in rows])
        states = {r["id"]: r for r in await run(what, "fetch", sql.states, [r[0] for r in rows])}
        out: list[Finish] = []
        for row_id, token, _ in rows:
            state = states.get(row_id)
            if state is None:  # deleted meanwhile: not ours any more
                out.append(Finish(None, None))
            elif state["claim_token"] == token and state["status"] == "done":
                out.append(Finish("done", token))
            else:
                current = state["claim_token"]
                out.append(Finish(None, None if current is None else int(current)))
        return out

    async def fail(
        self, row_id: Any, token: int, error: str, retry_in: float | None, max_attempts: int
    ) -> Finish:
        sql = self._sql or await self._resolve()
        return await self._finish(
            sql, sql.fail, "claim fail failed", row_id, token, error, retry_in, max_attempts
        )

    async def _finish(
        self, sql: Statements, statement: str, what: str, row_id: Any, token: int, *args: Any
    ) -> Finish:
        # A statement the database refuses (a constraint, a wrong type) raises its own
        # error, unchanged: nothing was written and the claim is still held.
        run = self._driver._run
        status = await run(what, "fetchval", statement, row_id, token, *args)
        if status is not None:
            return Finish(status, token)  # 'done', 'ready' or 'parked' (text)
        # Refused (rare): the token the row carries now, for StaleToken.
        current = await run(what, "fetchval", sql.current, row_id)
        return Finish(None, None if current is None else int(current))
