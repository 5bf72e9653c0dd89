"""Claims: rows of your own table taken with ``FOR UPDATE SKIP LOCKED``, each under a lease
whose completion is fenced by the row's claim token (docs/claims.md).

A claimed row is a lease of the backend's session (name ``claim:<table>:<id>``, a private
owner): the session's one renewer extends it, its watchdog cancels the row's work at the
local deadline (G3, G4), and the driver's ``extend`` renews every claimed row of a table
in one statement (:data:`_HEARTBEAT`), not one per row. Completion, failure and
give-back are single conditional UPDATEs on ``claim_token`` (G5, G8): a worker whose row
was reclaimed writes nothing and gets :class:`~asynclock.StaleToken`.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.lowlevel
import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.backend import parts_of
from ..._core.bounds import cleanup, shielded_call
from ..._core.context import ExcInfo
from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.exceptions import BackendUnavailable, StaleToken
from ..._core.lease import Lease, LossSignal
from ..._core.lock import lost_on_exit
from ..._core.misuse import AsyncContextOnly
from ..._core.validation import MAX_TTL, check_lease_ttl
from .connection import _CONNECTION_ERRORS
from .tokens import _EPOCH_TRIES, _new_epoch, _no_range

if TYPE_CHECKING:
    from ..._core.acquisition import Acquisition
    from ..._core.backend import Backend
    from ..._core.session import Session
    from .connection import PostgresDriver

__all__ = ("CLAIM_COLUMNS", "MAX_LIMIT", "Claim", "ClaimBatch", "Claims")

#: The most rows one ``take()`` claims (a claim is one short transaction holding row locks).
MAX_LIMIT = 1000

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

#: Longest backoff of ``fail()`` without ``retry_in`` (seconds): 1, 2, 4, ... up to this.
MAX_BACKOFF = 300.0


def _quote(name: str, what: str) -> str:
    """``name`` as a quoted SQL identifier; refuse what PostgreSQL would truncate or reject."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if not name or "\x00" in name or len(name.encode("utf-8", "surrogatepass")) > 63:
        raise ValueError(
            f"{what} must be a PostgreSQL identifier: 1 to 63 bytes, no NUL (it is quoted, "
            f"so any other character is allowed), got {name!r}"
        )
    return '"' + name.replace('"', '""') + '"'


def _check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int from 1 to {MAX_LIMIT}, not {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit must be from 1 to {MAX_LIMIT} rows per take() (each claim is one "
            f"transaction holding row locks), got {limit}"
        )
    return limit


def _check_attempts(max_attempts: object) -> int:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise TypeError(f"max_attempts must be an int >= 1, not {type(max_attempts).__name__}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1 (claims per row), got {max_attempts}")
    return max_attempts


def _check_sql(text: object, what: str) -> str | None:
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


class _Statements:
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
        self.claim = f"""
WITH r AS (SELECT base, lim FROM asynclock_token_range),
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
    FROM k WHERE t.{i} = k.id AND k.token <= k.lim
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
        # Give back (G5): args $1 ids, $2 tokens. Rows still carrying their token go back
        # to 'ready' at once (attempts stay counted). Returns nothing.
        self.give_back = f"""
UPDATE {t} AS t SET status = 'ready', claim_expires = NULL, run_after = clock_timestamp()
FROM unnest($1::{id_type}[], $2::bigint[]) AS u(id, token)
WHERE t.{i} = u.id AND t.claim_token = u.token AND t.status = 'claimed'"""
        # Fail (G8): args $1 id, $2 token, $3 error, $4 retry_in (s, NULL: backoff), $5
        # max_attempts. Only while the row carries $2 and is claimed: back to 'ready' after
        # the delay, or 'parked' once claimed max_attempts times. Returns (ok, current token).
        self.fail = f"""
WITH u AS (
    UPDATE {t} AS t SET
        status = CASE WHEN t.attempts >= $5 THEN 'parked' ELSE 'ready' END,
        claim_expires = NULL,
        last_error = $3,
        run_after = clock_timestamp() + coalesce(
            $4::float8, least({MAX_BACKOFF}, power(2, greatest(t.attempts - 1, 0)))
        ) * interval '1 second'
    WHERE t.{i} = $1 AND t.claim_token = $2 AND t.status = 'claimed'
    RETURNING t.status
)
SELECT (SELECT status FROM u) AS status, (SELECT claim_token FROM {t} WHERE {i} = $1) AS current"""
        self.table, self.id_col = t, i

    def complete(self, columns: Sequence[str]) -> str:
        """Complete (G8): args $1 id, $2 token, $3.. the result columns' values. One
        conditional UPDATE: only while the row carries $2 and is claimed, set status
        'done' and the results. Returns (status, current token): status NULL = refused."""
        sets = "".join(f", {col} = ${n}" for n, col in enumerate(columns, start=3))
        t, i = self.table, self.id_col
        return f"""
WITH u AS (
    UPDATE {t} AS t SET status = 'done', claim_expires = NULL{sets}
    WHERE t.{i} = $1 AND t.claim_token = $2 AND t.status = 'claimed'
    RETURNING t.status
)
SELECT (SELECT status FROM u) AS status, (SELECT claim_token FROM {t} WHERE {i} = $1) AS current"""


class Claims:
    """Claim rows of one table: ``async with claims.take(limit=N) as batch:``.

    Made by ``backend.claims(table, ttl=...)`` (PostgreSQL only); cheap, no I/O. The
    table's columns are checked on first use. See docs/claims.md.
    """

    def __init__(
        self,
        backend: Backend,
        driver: PostgresDriver,
        table: str,
        *,
        ttl: float,
        where: str | None = None,
        order_by: str | None = None,
        id_column: str = "id",
        schema: str | None = None,
        max_attempts: int = 5,
        identity: str | None = None,
    ) -> None:
        session, acq = parts_of(backend)
        self._session: Session = session
        self._acq: Acquisition = acq
        self._driver = driver
        self.ttl = check_lease_ttl(ttl)
        if self.ttl <= session.min_ttl:
            raise session.ttl_error(self.ttl)
        qualified = _quote(table, "table")
        if schema is not None:
            qualified = f"{_quote(schema, 'schema')}.{qualified}"
        self.table = table if schema is None else f"{schema}.{table}"
        self._qualified = qualified
        self.id_column = id_column
        self._id = _quote(id_column, "id_column")
        #: What renewal groups by: the claimed rows of one table (and id column) are renewed
        #: in one statement, whichever Claims object claimed them.
        self.key = f"{qualified}\x00{self._id}"
        self._where = _check_sql(where, "where")
        self._order_by = _check_sql(order_by, "order_by")
        self.max_attempts = _check_attempts(max_attempts)
        if identity is not None and not isinstance(identity, str):
            raise TypeError(f"identity must be a str or None, not {type(identity).__name__}")
        #: Written to ``claimed_by`` of every row this object claims.
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}"
        self._sql: _Statements | None = None
        self._columns: dict[str, str] = {}
        #: The id of each claimed row renewed here, by its lease owner.
        self._row_ids: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"<asynclock Claims {self.table!r} ttl={self.ttl:g}>"

    # -- schema ------------------------------------------------------------------------------

    async def create_table(self) -> None:
        """Create the table if it does not exist: ``id bigint`` identity primary key,
        ``payload jsonb``, ``result jsonb`` and the claim columns (:data:`CLAIM_COLUMNS`),
        with a partial index for claiming in id order. An existing table is left as is
        (then :meth:`ensure_columns` adds missing claim columns)."""
        cols = ",\n    ".join(f"{name} {spec}" for name, (_, spec) in CLAIM_COLUMNS.items())
        await self._exec(
            "create_table",
            f"""CREATE TABLE IF NOT EXISTS {self._qualified} (
    {self._id} bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    payload jsonb,
    result jsonb,
    {cols}
)""",
        )
        await self._index()
        self._sql = None

    async def ensure_columns(self) -> None:
        """Add the claim columns the table lacks (``ALTER TABLE ... ADD COLUMN IF NOT
        EXISTS``, with their defaults) and the claiming index; the table must exist."""
        await self._read_columns()
        adds = ", ".join(
            f"ADD COLUMN IF NOT EXISTS {name} {spec}" for name, (_, spec) in CLAIM_COLUMNS.items()
        )
        await self._exec("ensure_columns", f"ALTER TABLE {self._qualified} {adds}")
        await self._index()
        self._sql = None

    async def _index(self) -> None:
        # Claimable rows in id order without scanning finished ones.
        index = _quote(f"{self.table.rsplit('.', 1)[-1][:40]}_asynclock_claims", "index")
        await self._exec(
            "create index",
            f"CREATE INDEX IF NOT EXISTS {index} ON {self._qualified} ({self._id}) "
            "WHERE status IN ('ready', 'claimed')",
        )

    async def _exec(self, what: str, sql: str, *args: Any) -> Any:
        try:
            return await self._driver._run(f"claims {what}", "execute", sql, *args)
        except asyncpg.PostgresError as exc:
            raise ValueError(f"claims on {self.table!r}: {what} failed: {exc}") from None

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

    async def _resolve(self) -> _Statements:
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
        self._sql = _Statements(
            self._qualified, self._id, columns[self.id_column], self._where, self._order_by
        )
        return self._sql

    # -- claiming ----------------------------------------------------------------------------

    def take(self, limit: int = 1) -> ClaimBatch:
        """``async with claims.take(limit=N) as batch:`` claims up to ``limit`` rows now
        (from 1 to :data:`MAX_LIMIT`; fewer, or none, if fewer are claimable: it does not
        wait). Rows not completed or failed when the block ends are given back."""
        return ClaimBatch(self, _check_limit(limit))

    async def _claim(self, limit: int) -> list[Claim]:
        acq = self._acq.ready()
        sql = await self._resolve()
        ttl_ms = self.ttl * 1000.0
        clock = acq.clock
        driver = self._driver
        for _ in range(_EPOCH_TRIES):
            await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled already: claim nothing
            t_send = clock.now()
            # Shielded (G6): once sent, the claim may commit, so its rows must reach the
            # batch, whose exit gives them back if the caller was cancelled meanwhile.
            try:
                with anyio.fail_after(self._acq.bounds.timeout, shield=True):
                    row = await self._claim_statement(sql, limit, ttl_ms)
            except TimeoutError as exc:
                raise BackendUnavailable(
                    f"{driver.display}: claim on {self.table!r} got no answer within "
                    f"{self._acq.bounds.timeout:g}s; rows it may have claimed come back "
                    f"after the ttl ({self.ttl:g}s)"
                ) from exc
            claimed = [self._grant(r, t_send) for r in row["rows"]]
            if claimed or not (row["no_range"] or row["used_up"]):
                return claimed
        raise _no_range(f"claims on {self.table!r}")

    async def _claim_statement(self, sql: _Statements, limit: int, ttl_ms: float) -> Any:
        driver = self._driver
        async with driver._io:
            conn = await driver._main()
            try:
                row = await conn.fetchrow(
                    sql.claim, limit, self.identity, ttl_ms, self.max_attempts
                )
                if row["no_range"] or row["used_up"]:
                    await _new_epoch(conn)  # first token, or after a crash (G2)
            except _CONNECTION_ERRORS as exc:
                raise driver._unavailable("claim failed", exc) from exc
            except asyncpg.PostgresError as exc:
                raise ValueError(
                    f"claims on {self.table!r}: the claim statement failed ({exc}); check "
                    "where= and order_by="
                ) from None
        return row

    def _grant(self, record: Any, t_send: float) -> Claim:
        values = dict(record.items())
        row_id, token = values[self.id_column], int(values["claim_token"])
        owner = f"claim:{uuid.uuid4().hex}"
        name = f"claim:{self.table}:{row_id}"
        self._driver._claim_owners[owner] = self
        lease = self._session.grant(name, owner, token, self.ttl, t_send, None, self._acq)
        return Claim(self, lease, row_id, values)

    # -- the session's renewal (one statement per table per heartbeat) ----------------------

    async def renew(self, refs: Sequence[LeaseRef]) -> list[ExtendResult]:
        """Called by the driver's ``extend``: renew these claimed rows in one statement."""
        sql = await self._resolve()
        # A claim finished while this round was under way is no longer ours to renew (the
        # session skips its answer): it goes out as a NULL id, which matches no row.
        owners = self._driver._claim_owners
        ids = [
            None if (claims := owners.get(ref.owner)) is None else claims._row_ids.get(ref.owner)
            for ref in refs
        ]
        rows = await self._driver._run(
            "claim renewal failed",
            "fetch",
            sql.heartbeat,
            ids,
            [ref.token for ref in refs],
            [ref.ttl * 1000.0 for ref in refs],
        )
        done = {int(r["i"]) for r in rows}
        return [
            True if n in done else Refused("the row was reclaimed, completed or given back")
            for n in range(1, len(refs) + 1)
        ]

    def _forget(self, claim: Claim, why: str) -> None:
        """Stop renewing ``claim`` (finished, given back or lost)."""
        lease = claim.lease
        self._session.drop(lease, why)
        lease._released = True
        self._driver._claim_owners.pop(lease.owner, None)
        self._row_ids.pop(lease.owner, None)

    async def _give_back(self, claims: Sequence[Claim]) -> None:
        live = [c for c in claims if not c._finished]
        if not live:
            return
        for claim in live:
            claim._finished = True
            self._forget(claim, "given back")
        sql = await self._resolve()
        # Shielded and bounded like a release; if it fails the rows come back anyway once
        # their claims expire (logged, not raised over the block's own outcome).
        await cleanup(
            self._driver._run(
                "give back failed",
                "execute",
                sql.give_back,
                [c.id for c in live],
                [c.token for c in live],
            ),
            self._acq.bounds,
            f"giving back {len(live)} claimed rows of {self.table!r}",
        )


class ClaimBatch(AsyncContextOnly):
    """``async with claims.take(limit=N) as batch:`` — the rows claimed (iterable, sized)."""

    _usage = "claims.take(limit=...)"

    def __init__(self, claims: Claims, limit: int) -> None:
        self._claims = claims
        self._limit = limit
        self._items: list[Claim] = []
        self._entered = False

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a take() batch is entered once; call claims.take() again")
        self._entered = True
        self._items = await self._claims._claim(self._limit)
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> None:
        await self._claims._give_back(self._items)

    def __iter__(self) -> Iterator[Claim]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"<ClaimBatch {self._claims.table!r} {len(self._items)} rows>"


class Claim(AsyncContextOnly):
    """One claimed row: ``.id``, ``.row`` (its columns as claimed), ``.token``.

    ``async with claim:`` runs the row's work in a cancel scope cancelled when the claim
    is lost (then the block raises :class:`~asynclock.LeaseLost`); ``await
    claim.complete(**results)`` or ``await claim.fail(error)`` finish it, fenced.
    """

    _usage = "a claim from `async with claims.take(...) as batch: for claim in batch:`"

    def __init__(self, claims: Claims, lease: Lease, row_id: Any, row: dict[str, Any]) -> None:
        self._claims = claims
        self.lease = lease
        self.id = row_id
        self.row: Mapping[str, Any] = row
        self.token: int = lease.token
        self._finished = False
        self._scope: anyio.CancelScope | None = None
        claims._row_ids[lease.owner] = row_id

    def __repr__(self) -> str:
        state = "lost" if self.lost else "finished" if self._finished else "claimed"
        return f"<Claim {self._claims.table}:{self.id!r} token={self.token} {state}>"

    @property
    def lost(self) -> LossSignal:
        """Set (with a reason) once the claim is lost; ``await claim.lost`` waits for it."""
        return self.lease.lost

    def remaining(self) -> float:
        """Seconds until the local deadline (0 once lost or finished)."""
        return self.lease.remaining()

    def check(self) -> None:
        """Raise :class:`~asynclock.LeaseLost` if the claim is lost or past its deadline."""
        self.lease.check()

    async def __aenter__(self) -> Self:
        if self._scope is not None:
            raise RuntimeError(f"{self!r} is already entered")
        self._claims._acq.check_loop()
        scope = anyio.CancelScope()
        scope.__enter__()
        self._scope = scope
        self.lease._scope = scope
        if self.lease.lost:
            scope.cancel()
        return self

    async def __aexit__(self, *exc_info: *ExcInfo) -> bool:
        scope, self._scope = self._scope, None
        assert scope is not None, "Claim.__aexit__ without __aenter__"
        self.lease._scope = None
        swallowed = bool(scope.__exit__(*exc_info))
        if self.lease.lost.reason is not None and not self._finished:
            return lost_on_exit(self.lease, swallowed, exc_info[0])
        return swallowed

    async def complete(self, **results: Any) -> None:
        """Mark the row done and write ``results`` (column=value) in one conditional UPDATE,
        only if the row still carries this claim's token.

        Raises:
            StaleToken: the row was reclaimed (or given back); nothing was written.
            ValueError: a result column the table lacks, or a claim column.
            RuntimeError: the claim was already completed or failed.
            BackendUnavailable: no answer; the claim is no longer renewed, so the row is
                claimed again after its ttl unless the completion had landed.
        """
        claims = self._claims
        sql = await claims._resolve()
        for col in results:
            if col in CLAIM_COLUMNS or col == claims.id_column:
                raise ValueError(
                    f"complete() cannot set {col!r}: the claim columns and the id are "
                    "asynclock's; pass your own result columns"
                )
            if col not in claims._columns:
                raise ValueError(
                    f"complete(): table {claims.table!r} has no column {col!r}; its columns: "
                    f"{', '.join(sorted(claims._columns))}"
                )
        cols = [_quote(col, "column") for col in results]
        await self._finish(sql.complete(cols), "complete", *results.values())

    async def fail(self, error: object, *, retry_in: float | None = None) -> bool:
        """Record ``error`` (its ``str``) and give the row back to be retried after
        ``retry_in`` seconds (default: 1, 2, 4, ... per attempt, at most 300). A row
        claimed ``max_attempts`` times is parked instead (status 'parked', never claimed
        again). Returns True if parked. Fenced like :meth:`complete` (StaleToken)."""
        if retry_in is not None:
            if isinstance(retry_in, bool) or not isinstance(retry_in, (int, float)):
                raise TypeError("retry_in must be None or a number of seconds >= 0")
            if not 0 <= retry_in <= MAX_TTL or math.isnan(retry_in):
                raise ValueError(
                    f"retry_in must be from 0 to {MAX_TTL:g} seconds, got {retry_in!r}"
                )
        sql = await self._claims._resolve()
        status = await self._finish(
            sql.fail, "fail", str(error), retry_in, self._claims.max_attempts
        )
        return status == "parked"

    async def _finish(self, sql: str, what: str, *args: Any) -> str:
        if self._finished:
            raise RuntimeError(f"{self!r} is already finished; {what}() runs once per claim")
        claims = self._claims
        claims._acq.check_loop()
        self._finished = True
        # Out of renewal first: a heartbeat after the UPDATE would find the row no longer
        # claimed and cancel the work that just finished.
        claims._forget(self, what)
        try:
            row = await shielded_call(
                claims._driver._run(
                    f"claim {what} failed", "fetchrow", sql, self.id, self.token, *args
                ),
                claims._acq.bounds,
            )
        except asyncpg.PostgresError as exc:
            raise ValueError(f"claim {what}() on {claims.table!r} failed: {exc}") from None
        if row is None:
            raise BackendUnavailable(f"claim {what}() on {claims.table!r}: no answer")
        if row["status"] is None:
            current = row["current"]
            raise StaleToken(
                f"{claims.table}:{self.id}", self.token, None if current is None else int(current)
            )
        return str(row["status"])
