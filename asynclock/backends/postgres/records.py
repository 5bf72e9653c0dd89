"""The PostgreSQL driver's idempotency records: a table beside the leases, created on first
use (the fenced store that writes them is per mode: ``session``/``lease``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._core.driver import Record
from ..._core.exceptions import BackendUnavailable
from .sql import SQL_RECORD_DELETE, SQL_RECORD_EXISTS, SQL_RECORD_GET, SQL_RECORD_SCHEMA
from .tokens import _name_bytes


class PostgresRecords:
    """Record reads and deletes of :class:`~asynclock.backends.postgres.PostgresDriver` (a
    mixin over its pinned connection's ``_run``)."""

    #: True once the record table is known to exist (created on first use).
    _record_table = False

    if TYPE_CHECKING:

        async def _run(
            self, what: str, fetch: str, sql: str, *args: Any, first: bool = False
        ) -> Any: ...

    async def _record(self, what: str, fetch: str, sql: str, *args: Any) -> Any:
        """``_run`` for a record statement, creating the record table first if missing."""
        if not self._record_table:
            if not await self._run(what, "fetchval", SQL_RECORD_EXISTS):
                await self._run(
                    f"{what} (creating table asynclock_record)", "execute", SQL_RECORD_SCHEMA
                )
            self._record_table = True
        try:
            return await self._run(what, fetch, sql, *args)
        except BackendUnavailable:
            # The pinned connection was lost (mode session: closed by idle_session_timeout
            # while this process was frozen). Record statements are safe to repeat (a read,
            # or a write fenced by the token), so once more on a new connection: the answer
            # is then the server's (a refusal is StaleToken), not "connection lost".
            return await self._run(what, fetch, sql, *args)

    async def record_get(self, name: str) -> Record | None:
        row = await self._record("record_get failed", "fetchrow", SQL_RECORD_GET, _name_bytes(name))
        return None if row is None else Record(int(row[0]), str(row[1]))

    async def record_delete(self, name: str, token: int) -> bool:
        found = await self._record(
            "record_delete failed", "fetchval", SQL_RECORD_DELETE, _name_bytes(name), token
        )
        return found is not None
