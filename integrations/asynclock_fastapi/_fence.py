"""The resource side: read the writer's fencing token from a request header (G8 over HTTP).

The token is only half of the fence; the other half is the check *atomic with the write*,
which the existing fences do (``asynclock.fence.SQLFence`` in the write's transaction,
``RedisFence`` in one Lua call). A stale token raises ``StaleToken``, which the handler
:func:`asynclock_fastapi.install` adds turns into 412 Precondition Failed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException, Request

from asynclock.fence import RedisFence, SQLFence

from ._locks import DEFAULT_HEADER, check_header_name

#: Fencing tokens are positive 64-bit ints (they fit SQL BIGINT and Redis INCR).
MAX_TOKEN = 2**63 - 1
_TOKEN_DIGITS = len(str(MAX_TOKEN))


class FencingToken:
    """Dependency: the request's fencing token, an int from header ``header``.

    ``token: int = Depends(fencing_token)`` reads ``Fencing-Token``;
    ``Depends(FencingToken("X-Fence"))`` reads another header. Answers, before your
    endpoint runs: **428** when the header is missing, **400** when it is not one positive
    integer (saying what is allowed). ``install(app)`` documents the header (and those
    answers) in the route's OpenAPI operation.
    """

    def __init__(self, header: str = DEFAULT_HEADER) -> None:
        self.header = check_header_name(header, "FencingToken header")

    def __repr__(self) -> str:
        return f"FencingToken({self.header!r})"

    # Only the request, no ``Header()`` parameter: FastAPI's per-request handling of one
    # declared header parameter cost more than the rest of the dependency (about 150
    # Python calls a request, measured with cProfile); ``install`` documents the header.
    async def __call__(self, request: Request) -> int:
        return self.parse(request.headers.getlist(self.header))

    def openapi_parameter(self) -> dict[str, Any]:
        """The OpenAPI entry of the header (``install`` adds it to fenced operations)."""
        return {
            "name": self.header,
            "in": "header",
            "required": True,
            "description": "the fencing token of the writer's lease; missing: 428, "
            "malformed: 400, older than one this resource accepted: 412",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOKEN},
        }

    def parse(self, values: list[str]) -> int:
        """The token from the header's values, or HTTPException 428/400."""
        if not values:
            raise HTTPException(
                428,
                detail=f"this write is fenced: send the writer's lease token in the "
                f"{self.header} header (a positive integer)",
            )
        if len(values) > 1:
            raise HTTPException(
                400, detail=f"{self.header} header given {len(values)} times; send it once"
            )
        raw = values[0].strip()
        digits = raw.lstrip("0")
        # Length first: int() of a few thousand digits raises (Python's int-string limit),
        # and the header is anyone's to send.
        if (
            not (raw.isascii() and raw.isdigit())
            or len(digits) > _TOKEN_DIGITS
            or not 1 <= int(digits or "0") <= MAX_TOKEN
        ):
            shown = raw if len(raw) <= 40 else raw[:40] + "..."
            raise HTTPException(
                400,
                detail=f"malformed {self.header} header {shown!r}: it must be one positive "
                f"integer (decimal digits, 1 to {MAX_TOKEN})",
            )
        return int(digits)


#: ``token: int = Depends(fencing_token)``: the ``Fencing-Token`` header as an int.
fencing_token = FencingToken()


class FencedWrite:
    """The request's fencing token, bound to the fences that apply it *with* a write.

    Each method checks the token atomically with your write, so a route cannot forget to
    pass the token along: SQL inside your transaction, Redis in one Lua call. A stale
    token raises :class:`~asynclock.StaleToken` (412 with ``install``); nothing is
    written. ``token`` is the int, for anything else.
    """

    __slots__ = ("redis", "sql", "token")

    def __init__(self, token: int, sql: SQLFence, redis: RedisFence) -> None:
        self.token = token
        self.sql = sql
        self.redis = redis

    def __repr__(self) -> str:
        return f"FencedWrite(token={self.token})"

    # SQL: call inside the transaction that does the write.
    async def asyncpg(self, conn: Any, key: str) -> None:
        """Inside ``async with conn.transaction():`` (asyncpg), before or after your write."""
        await self.sql.check_asyncpg(conn, key, self.token)

    async def aiosqlite(self, conn: Any, key: str) -> None:
        """Inside your aiosqlite transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``)."""
        await self.sql.check_aiosqlite(conn, key, self.token)

    def sqlite(self, conn: sqlite3.Connection, key: str) -> None:
        """Inside your open sqlite3 transaction."""
        self.sql.check_sqlite(conn, key, self.token)

    @contextmanager
    def sqlite_transaction(
        self, conn: sqlite3.Connection, key: str
    ) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``, the check, your writes, ``COMMIT`` (or ``ROLLBACK``)."""
        with self.sql.sqlite_transaction(conn, key, self.token) as tx:
            yield tx

    # Redis: the check and the write are one Lua call.
    async def redis_set(
        self, client: Any, key: str, value: str | bytes, *, px: int | None = None
    ) -> None:
        await self.redis.set(client, key, value, self.token, px=px)

    async def redis_hset(self, client: Any, key: str, mapping: Mapping[str, Any]) -> None:
        await self.redis.hset(client, key, mapping, self.token)

    async def redis_delete(self, client: Any, key: str) -> None:
        await self.redis.delete(client, key, self.token)


class FencedWrites(FencingToken):
    """Dependency: a :class:`FencedWrite` for the request's token (428/400 like ``FencingToken``).

    ``write: FencedWrite = Depends(fenced_write)``; ``FencedWrites("X-Fence",
    sql=SQLFence("my_marks"))`` for another header or fence table.
    """

    def __init__(
        self,
        header: str = DEFAULT_HEADER,
        *,
        sql: SQLFence | None = None,
        redis: RedisFence | None = None,
    ) -> None:
        if sql is not None and not isinstance(sql, SQLFence):
            raise TypeError(f"sql= must be an asynclock.fence.SQLFence, not {type(sql).__name__}")
        if redis is not None and not isinstance(redis, RedisFence):
            raise TypeError(
                f"redis= must be an asynclock.fence.RedisFence, not {type(redis).__name__}"
            )
        self.sql = sql or SQLFence()
        self.redis = redis or RedisFence()
        super().__init__(header)

    def __repr__(self) -> str:
        return f"FencedWrites({self.header!r}, sql={self.sql!r}, redis={self.redis!r})"

    async def __call__(self, request: Request) -> FencedWrite:  # type: ignore[override]
        return FencedWrite(self.parse(request.headers.getlist(self.header)), self.sql, self.redis)


#: ``write: FencedWrite = Depends(fenced_write)``: the token and the default fences.
fenced_write = FencedWrites()


def fence_responses(header: str = DEFAULT_HEADER) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of a fenced route (``install`` adds them; or pass to responses=)."""
    return {
        400: {"description": f"Malformed {header} header: it must be one positive integer"},
        412: {
            "description": f"Precondition Failed: the {header} is older than the newest token "
            "this resource accepted (a stale writer); nothing was written"
        },
        428: {"description": f"Precondition Required: the {header} header is missing"},
    }
