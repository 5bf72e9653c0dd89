"""``mode=lease``: a lease table, one conditional statement per operation (any pooler)."""

from __future__ import annotations

from collections.abc import Sequence

from ..._core.driver import SENT_AT, Busy, ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .connection import _CONNECTION_ERRORS, PostgresDriver
from .sql import (
    SQL_L_ACQUIRE,
    SQL_L_BREAK,
    SQL_L_EXTEND,
    SQL_L_HOLDER,
    SQL_L_RECORD_PUT,
    SQL_L_RELEASE,
    SQL_L_TTL,
    SQL_L_VALIDATE,
)
from .tokens import _EPOCH_TRIES, _name_bytes, _new_epoch, _no_range, notify_channel, waiter_key


class LeaseDriver(PostgresDriver):
    """A lease table (``mode="lease"``)."""

    mode = "lease"
    _carries = "its lease statements"
    _pooler_ok = True

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
        async with self._io:
            conn = await self._main()
            try:
                live = await conn.fetchval(
                    SQL_L_RELEASE,
                    _name_bytes(name),
                    owner,
                    token,
                    notify_channel(name),
                    *waiter_key(name),
                )
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("release failed", exc) from exc
        if live is not None:
            self._wake_turn(name)
        return bool(live)

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
