"""``mode=lease``: a lease table, one conditional statement per operation (any pooler)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._core.driver import SENT_AT, Busy, ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .._common.coalesce import Coalesced
from .connection import _CONNECTION_ERRORS, PostgresDriver
from .sql import (
    SQL_L_ACQUIRE,
    SQL_L_BREAK,
    SQL_L_EXTEND,
    SQL_L_HOLDER,
    SQL_L_RECORD_PUT,
    SQL_L_RELEASE,
    SQL_L_RELEASE_MANY,
    SQL_L_TTL,
    SQL_L_VALIDATE,
)
from .tokens import _EPOCH_TRIES, _name_bytes, _new_epoch, _no_range, notify_channel, waiter_key


class LeaseDriver(PostgresDriver):
    """A lease table (``mode="lease"``)."""

    mode = "lease"
    _carries = "its lease statements"
    _pooler_ok = True

    def __init__(self, dsn: str, **options: Any) -> None:
        super().__init__(dsn, **options)
        # Releases made while one is in flight (many blocks exiting at once) go out
        # together, one statement per batch: 50,000 one statement each took 10 s, and the
        # leases at the end of the line expired at the server first (their renewal stops
        # when their release begins; issue 45 item 3).
        self._releases: Coalesced[_Release, bool | None] = Coalesced(
            self._release_one,
            self._release_many,
            limit=RELEASE_BATCH,
            what=f"{self.display}: release",
        )

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        if (turn := self._not_your_turn(name, owner, queue)) is not None:
            return turn  # ``scope`` needs nothing here (see "local turns" in connection.py)
        return self._took_turn(name, owner, queue, await self._acquire(name, owner, ttl))

    async def _acquire(
        self, name: str, owner: str, ttl: float, *, raced: bool = False
    ) -> int | Busy:
        async with self._io:
            conn = await self._main()
            try:
                for _ in range(_EPOCH_TRIES):
                    SENT_AT.set(self.clock.now())  # after the wait for the connection
                    rows = await conn.fetch(SQL_L_ACQUIRE, _name_bytes(name), owner, ttl * 1000.0)
                    if any(r["token"] is None and r["left_s"] is None for r in rows):
                        await _new_epoch(conn)  # the token range is missing or used up
                    elif any(r["left_s"] == -1 for r in rows):
                        # The longest lease ttl yet: on disk before such a lease exists.
                        await conn.execute(SQL_L_TTL, ttl * 1000.0)
                    else:
                        break
                else:
                    raise _no_range(self.display)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("acquire failed", exc) from exc
        if not rows:
            # The row vanished between the insert's conflict and our read: try again now.
            return Busy(0.0)
        row = rows[0]
        if row["token"] is None and row["left_s"] == 0 and not raced:
            # Free, but our token was taken before another holder's came and went while
            # we waited for the row (SQL_L_ACQUIRE): once more at once, with a fresh one.
            return await self._acquire(name, owner, ttl, raced=True)
        if row["token"] is not None:
            return int(row["token"])
        left = float(row["left_s"])
        return Busy(min(left, self.poll) if self._pooled else left)

    async def _extend_locks(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        async with self._io.first:
            conn = await self._main()
            try:
                rows = await conn.fetch(
                    SQL_L_EXTEND,
                    [_name_bytes(r.name) for r in leases],
                    [r.owner for r in leases],
                    [r.token for r in leases],
                    [r.ttl * 1000.0 for r in leases],
                )
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("renewal failed", exc) from exc
        done = {int(r["i"]) for r in rows}
        return [
            True if i in done else Refused("lease row expired, deleted or taken over")
            for i in range(1, len(leases) + 1)
        ]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        key = _name_bytes(name)
        args = (key, owner, token, notify_channel(name), *waiter_key(name))
        live = await self._releases(key, args)
        if live is not None:
            self._wake_turn(name)
        return bool(live)

    async def _release_one(self, args: _Release) -> bool | None:
        """SQL_L_RELEASE: None if the row was not ours (nothing released), else whether
        the lease was still live."""
        async with self._io:
            conn = await self._main()
            try:
                live: bool | None = await conn.fetchval(SQL_L_RELEASE, *args)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("release failed", exc) from exc
        return live

    async def _release_many(self, batch: list[_Release]) -> list[bool | None]:
        """SQL_L_RELEASE_MANY: each release's answer, as :meth:`_release_one`'s (the
        batch has one release per name: see ``Coalesced``)."""
        if len(batch) == 1:
            return [await self._release_one(batch[0])]
        columns = [list(column) for column in zip(*batch, strict=True)]
        async with self._io:
            conn = await self._main()
            try:
                rows = await conn.fetch(SQL_L_RELEASE_MANY, *columns)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("release failed", exc) from exc
        answers: list[bool | None] = [None] * len(batch)
        for i, live in rows:
            answers[i - 1] = live
        return answers

    async def aclose(self) -> None:
        self._releases.close(f"{self.display} was closed")
        await super().aclose()

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        from .semaphore import PostgresPermits

        return PostgresPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        from .rwlock import PostgresRW

        return PostgresRW(self, name)

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        args = (_name_bytes(name), owner, token, payload, keep * 1000.0)
        return (
            await self._record("record_put failed", "fetchval", SQL_L_RECORD_PUT, *args) is not None
        )

    # -- validate, holder and break_lock -------------------------------------------------

    async def validate(self, name: str, token: int) -> bool:
        ok = await self._run(
            "validate failed", "fetchval", SQL_L_VALIDATE, _name_bytes(name), token
        )
        return bool(ok)

    async def names(self) -> list[str]:
        rows = await self._run(
            "listing names failed",
            "fetch",
            "SELECT name FROM asynclock_lease WHERE expires_at > clock_timestamp()",
        )
        return [bytes(row[0]).decode("utf-8", "surrogatepass") for row in rows]

    async def holder(self, name: str) -> Holder | None:
        row = await self._run("holder failed", "fetchrow", SQL_L_HOLDER, _name_bytes(name))
        return None if row is None else Holder(name, row[0], int(row[1]), float(row[2]))

    async def break_lock(self, name: str) -> bool:
        token = await self._run(
            "break_lock failed",
            "fetchval",
            SQL_L_BREAK,
            _name_bytes(name),
            notify_channel(name),
            *waiter_key(name),
        )
        if token is not None:
            self._wake_turn(name)
        return token is not None


#: The most releases one statement carries. Each may take an advisory lock until the
#: statement commits (its waiter check, see SQL_L_RELEASE_MANY), and the server's lock
#: table (about 6,400 with the defaults) is shared by every session: 500 leaves room.
RELEASE_BATCH = 500

#: SQL_L_RELEASE's arguments: name, owner, token (None: any), channel, waiter key.
_Release = tuple[bytes, str, "int | None", str, int, int]
