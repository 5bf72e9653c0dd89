"""Idempotency records of the SQLite backend: a table beside the leases (the statements and
what they guarantee are in :mod:`.sql`)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..._core.driver import Record
from ..._core.errors import ErrorMapper
from .sql import SQL_RECORD_DELETE, SQL_RECORD_GET, SQL_RECORD_PRUNE, SQL_RECORD_PUT

T = TypeVar("T")


class Records:
    """The record half of :class:`~asynclock.backends.sqlite.SQLiteDriver`."""

    boot: str
    _errors: ErrorMapper

    if TYPE_CHECKING:

        @property
        def db(self) -> sqlite3.Connection: ...

        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _statement(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor: ...

    async def record_get(self, name: str) -> Record | None:
        try:
            row = self.db.execute(SQL_RECORD_GET, (name, time.time())).fetchone()
        except sqlite3.Error as exc:
            raise self._errors.unavailable("record_get failed", exc) from exc
        return None if row is None else Record(int(row[0]), str(row[1]))

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        boot = self.boot

        def put(db: sqlite3.Connection) -> bool:
            wall = time.time()
            db.execute(SQL_RECORD_PRUNE, (wall,))
            args = (name, owner, token, payload, wall + keep, boot, time.monotonic())
            return db.execute(SQL_RECORD_PUT, args).fetchone() is not None

        return await self._write(put)

    async def record_delete(self, name: str, token: int) -> bool:
        cursor = await self._statement(SQL_RECORD_DELETE, (name, token))
        return cursor.rowcount == 1
