"""``asynclock holder claim:<table>:<id>``: a claimed row as the table says it (who claimed
it, its token, its claim's time left, or stuck: claimed past its ttl)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._core.holder import Holder
from .claim_sql import MAX_IDENTIFIER, quote

if TYPE_CHECKING:
    from .connection import PostgresDriver

#: The claim columns of one row, and whether its claim expired (``claim_holder``).
_SQL_CLAIMED_ROW = """SELECT status, claim_token, claimed_by, attempts,
    extract(epoch FROM claim_expires - clock_timestamp())::float8 AS left_s
FROM {table} WHERE {id}::text = $1"""


async def claim_holder(driver: PostgresDriver, name: str) -> Holder | None:
    """``backend.holder("claim:<table>:<id>")``: the row's claim as the table says (see
    :meth:`asynclock.Driver.claim_holder`). The table and id are found by trying each
    ``:`` in the name (a table's name may hold one): the first split whose table exists
    with the claim columns and has a row of that id."""
    rest = name[len("claim:") :]
    for cut in [i for i, ch in enumerate(rest) if ch == ":"]:
        table, row_id = rest[:cut], rest[cut + 1 :]
        for qualified in _qualified_candidates(table):
            exists = await driver._run(
                "holder failed",
                "fetchval",
                """SELECT count(*) = 2 FROM pg_attribute
                   WHERE attrelid = to_regclass($1) AND attname IN ('claim_token', 'claim_expires')
                     AND NOT attisdropped""",
                qualified,
            )
            if not exists:
                continue
            for id_column in await _unique_columns(driver, qualified):
                sql = _SQL_CLAIMED_ROW.format(table=qualified, id=quote(id_column, "column"))
                row = await driver._run("holder failed", "fetchrow", sql, row_id)
                if row is None:
                    continue
                return _claim_as_holder(name, table, row)
    raise LookupError(name)


def _qualified_candidates(table: str) -> list[str]:
    """``table`` (as claims names it: ``name`` or ``schema.name``) as quoted SQL names."""
    found = [quote(table, "table")] if len(table.encode()) <= MAX_IDENTIFIER else []
    for i, ch in enumerate(table):
        if ch == ".":
            schema, rel = table[:i], table[i + 1 :]
            if schema and rel and max(len(schema.encode()), len(rel.encode())) <= MAX_IDENTIFIER:
                found.append(f"{quote(schema, 'schema')}.{quote(rel, 'table')}")
    return found


async def _unique_columns(driver: PostgresDriver, qualified: str) -> list[str]:
    """The table's single-column unique keys (its primary key first): where a claim's id is."""
    rows = await driver._run(
        "holder failed",
        "fetch",
        """SELECT a.attname FROM pg_index AS i
           JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
           WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indnatts = 1
           ORDER BY i.indisprimary DESC""",
        qualified,
    )
    return [r["attname"] for r in rows] or ["id"]


def _claim_as_holder(name: str, table: str, row: Any) -> Holder | None:
    if row["status"] != "claimed":
        return None
    left = float(row["left_s"]) if row["left_s"] is not None else 0.0
    who = row["claimed_by"] or "an unknown worker"
    token = None if row["claim_token"] is None else int(row["claim_token"])
    if left > 0:
        detail = f"a claimed row of table {table}, claimed by {who} (attempt {row['attempts']})"
        return Holder(name, row["claimed_by"], token, left, detail=detail)
    detail = (
        f"a STUCK row of table {table}: claimed by {who} (attempt {row['attempts']}), its claim "
        f"expired {-left:.1f}s ago and was not renewed; the next take() reclaims it"
    )
    return Holder(name, row["claimed_by"], token, 0.0, detail=detail)
