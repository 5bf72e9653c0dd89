"""``mode=session``: session advisory locks on one pinned connection per backend."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.driver import SENT_AT, Busy, ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .connection import _CONNECTION_ERRORS, _LOCK_TABLE_FULL, PostgresDriver, _close
from .sql import (
    SQL_S_ACQUIRE,
    SQL_S_ACQUIRE_PLAIN,
    SQL_S_BREAK,
    SQL_S_BREAK_NOWAIT,
    SQL_S_CHECK,
    SQL_S_CHECK_PLAIN,
    SQL_S_DROP_TOKEN_LOCKS,
    SQL_S_HOLDER,
    SQL_S_HOLDER_SESSION,
    SQL_S_HOLDER_WHO,
    SQL_S_RECORD_PUT,
    SQL_S_RELEASE,
    SQL_S_TOKEN,
    SQL_S_UNLOCK_BARE,
    SQL_S_VALIDATE,
)
from .tokens import (
    _EPOCH_TRIES,
    _name_bytes,
    _new_epoch,
    _no_range,
    lock_key,
    notify_channel,
    waiter_key,
)


class SessionDriver(PostgresDriver):
    """Session advisory locks (``mode="session"``)."""

    mode = "session"
    # An advisory lock carries no value: another session's holder has no owner we can read.
    tells_owner = False
    #: One renewal call for every hold: its check reads all of pg_locks once, so chunks
    #: of 1,000 read it again for each chunk (2,000 holds: twice a round; 10,000: ten times).
    renew_chunk = None

    def __init__(self, dsn: str, **options: Any) -> None:
        super().__init__(dsn, **options)
        # Which local owner holds (or is acquiring) each name on our session. Advisory
        # locks are re-entrant per session, so this is what stops two tasks of this
        # backend from both "getting" a name.
        self._holders: dict[str, str] = {}
        self._ttls: dict[str, float] = {}
        self._tokens: dict[str, int] = {}
        # When each hold would have expired had it been a lease: t_send + ttl of its last
        # acquire/extend. A hold the core stopped renewing (lost locally, never released)
        # is unlocked once this passes, so successors wait at most a ttl, as elsewhere.
        self._expires: dict[str, float] = {}

    def _lose_all(self, reason: str) -> None:
        held, self._holders = self._holders, {}
        self._ttls.clear()
        self._tokens.clear()
        self._expires.clear()
        for name, owner in held.items():
            self._notify_lost(name, owner, reason)

    def _forget_all(self) -> None:
        self._holders.clear()
        self._ttls.clear()
        self._tokens.clear()
        self._expires.clear()

    def _broken(self, conn: asyncpg.Connection, exc: BaseException) -> None:
        """A statement failed in a way that leaves the session state unknown: drop it."""
        current = self._conn
        if current is None or current is not conn:
            return
        self._conn = None
        self._lose_all(f"PostgreSQL session state unknown after an error: {exc!r}")
        current.terminate()

    def _idle_change(self, *ttls: float) -> str | None:
        """The idle_session_timeout (ms) the session needs, if it differs from the
        current one: the longest ttl held, so the server ends a silent client's session
        (freeing its locks) no sooner than ttl after its last statement (G3)."""
        if not self._idle_timeout:
            return None
        longest = max((*self._ttls.values(), *ttls), default=0.0)
        wanted = str(math.ceil(longest * 1000))
        if wanted == self._idle_set:
            return None
        self._idle_set = wanted
        return wanted

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        if (turn := self._not_your_turn(name, owner, queue)) is not None:
            return turn  # ``scope`` needs nothing here (see "local turns" in connection.py)
        # Under the connection lock: a release in flight on our session finishes first.
        async with self._io:
            for retry in (True, False):
                conn = await self._main()
                try:
                    result = await self._session_acquire(conn, name, owner, ttl)
                    return self._took_turn(name, owner, queue, result)
                except _LOCK_TABLE_FULL as exc:
                    await self._undo_full(conn, name, owner)
                    raise self._table_full(f"acquire of {name!r} refused", exc) from None
                except Exception as exc:
                    if not self._dead(conn, exc):
                        raise
                    # The session is gone (e.g. the server ended it at idle_session_timeout
                    # while we were waiting) and every lock with it: start a new one.
                    self._broken(conn, exc)
                    if not retry:
                        raise self._unavailable("acquire failed", exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _session_acquire(
        self, conn: asyncpg.Connection, name: str, owner: str, ttl: float
    ) -> int | Busy:
        if name in self._holders:
            # Another task of this backend holds it (advisory locks are re-entrant).
            left = self._expires.get(name, math.inf) - self.clock.now()
            if left > 0:
                return Busy(min(self.poll, left))
            await self._unlock_unrenewed(conn, [name])
        t_send = self.clock.now()
        SENT_AT.set(t_send)  # after the wait for the connection
        # Reserve before asking: if we are interrupted the server may have granted the
        # lock, and release(name, owner, None) must know to unlock it (G6).
        self._holders[name] = owner
        key = lock_key(name)
        try:
            idle = self._idle_change(ttl)
            if idle is None:
                row = await conn.fetchrow(SQL_S_ACQUIRE_PLAIN, key)
            else:
                row = await conn.fetchrow(SQL_S_ACQUIRE, key, idle)
        except BaseException:
            self._idle_set = None  # unknown whether the setting stuck
            raise
        assert row is not None
        ok, token = row
        if not ok:
            del self._holders[name]
            return Busy(self.poll)
        for _ in range(_EPOCH_TRIES):
            if token is not None:
                break
            # Granted, but the token range is missing (first use, or emptied by crash
            # recovery) or used up. Interrupted here, the core's release(name, owner,
            # None) unlocks (G6).
            await _new_epoch(conn)
            token = await conn.fetchval(SQL_S_TOKEN, key, column=1)
        if token is None:
            raise _no_range(self.display)  # the core's release(name, owner, None) unlocks
        self._ttls[name] = ttl
        self._expires[name] = t_send + ttl
        self._tokens[name] = token = int(token)
        return token

    async def _undo_full(self, conn: asyncpg.Connection, name: str, owner: str) -> None:
        """An acquire refused by a full lock table (call with ``_io`` held): it may have taken
        the name's lock before its token lock failed (session advisory locks survive the
        statement's error; the token lock is the one that failed, so none is left). Unlock
        it with a statement that takes no lock table entry (reading pg_locks takes one);
        every other hold of the session stays as it was."""
        if self._holders.get(name) != owner:
            return
        try:
            await conn.fetchval(SQL_S_UNLOCK_BARE, lock_key(name), None)
        except BaseException as exc:
            self._broken(conn, exc)  # unknown what is held: end the session (frees it)
            raise
        del self._holders[name]

    def _dead(self, conn: asyncpg.Connection, exc: BaseException) -> bool:
        """Did ``exc`` come from a connection that is gone (or unusable)?"""
        current = self._conn
        if current is None or conn is not current:
            return True
        closed: bool = current.is_closed()
        return closed or isinstance(
            exc, (*_CONNECTION_ERRORS, asyncpg.exceptions.InternalClientError)
        )

    async def _extend_locks(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        async with self._io.first:
            conn = await self._main()
            keys = [lock_key(ref.name) for ref in leases]
            t_send = self.clock.now()
            unrenewed = [n for n, at in self._expires.items() if at <= t_send]
            if unrenewed:
                await self._unlock_unrenewed(conn, unrenewed)
            for ref in leases:  # lease.extend(ttl) may change a ttl: idle timeout follows
                if self._holders.get(ref.name) == ref.owner and ref.name in self._ttls:
                    self._ttls[ref.name] = ref.ttl
            try:
                idle = self._idle_change()
                if idle is None:
                    row = await conn.fetchrow(SQL_S_CHECK_PLAIN, keys)
                else:
                    row = await conn.fetchrow(SQL_S_CHECK, keys, idle)
            except _LOCK_TABLE_FULL:
                self._idle_set = None  # set again by the next check that runs
                row = await self._same_session(conn)
            except BaseException as exc:
                self._idle_set = None
                if isinstance(exc, Exception) and self._dead(conn, exc):
                    self._broken(conn, exc)
                    raise self._unavailable("renewal failed", exc) from exc
                raise
        assert row is not None
        missing = set(row["missing"])
        results: list[ExtendResult] = []
        for ref, key in zip(leases, keys, strict=True):
            if self._holders.get(ref.name) != ref.owner or self._tokens.get(ref.name) != ref.token:
                results.append(Refused("this session no longer holds the lock"))
            elif key in missing:
                results.append(
                    Refused(
                        "the advisory lock is no longer held by this PostgreSQL session "
                        "(unlocked, session terminated, or a pooler moved the session)"
                    )
                )
            else:
                self._expires[ref.name] = t_send + ref.ttl
                results.append(True)
        return results

    async def _same_session(self, conn: asyncpg.Connection) -> dict[str, list[int]]:
        """The renewal check when the lock table is full (reading pg_locks needs an entry):
        the session is still the one that took the locks (same server pid), and only this
        driver unlocks them, so every lock it has not unlocked is still held."""
        try:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
        except BaseException as exc:
            if isinstance(exc, Exception) and self._dead(conn, exc):
                self._broken(conn, exc)
                raise self._unavailable("renewal failed", exc) from exc
            raise
        if pid != conn.get_server_pid():
            moved = RuntimeError(f"server pid {pid}, not {conn.get_server_pid()}: a pooler?")
            self._broken(conn, moved)
            raise self._unavailable("renewal failed", moved)
        return {"missing": []}

    async def _unlock_unrenewed(self, conn: asyncpg.Connection, names: list[str]) -> None:
        """Unlock holds whose ttl passed without a renewal (call with ``_io`` held)."""
        for name in names:
            await self._unlock_or_end(conn, name)
            self._wake_turn(name)

    async def _unlock_or_end(self, conn: asyncpg.Connection, name: str) -> None:
        """Unlock our hold of ``name`` and forget it; if that fails, end the session
        (the only sure way to free the key). Call with ``_io`` held."""
        try:
            await self._unlock(conn, name)
        except BaseException as exc:
            self._broken(conn, exc)
            raise
        self._forget(name)

    async def _unlock(self, conn: asyncpg.Connection, name: str) -> bool | None:
        """Run SQL_S_RELEASE for our hold of ``name`` (call with ``_io`` held); if its token
        never reached us (an interrupted acquire), drop the token lock we cannot name."""
        key = lock_key(name)
        token = self._tokens.get(name)
        try:
            held: bool | None = await conn.fetchval(
                SQL_S_RELEASE, key, notify_channel(name), *waiter_key(name), token
            )
        except _LOCK_TABLE_FULL:
            # The waiter probe (a transaction lock) found the lock table full; the unlocks
            # before it may have run (not transactional). Unlock without it: waiters in
            # other processes find the name free at their next poll, not by a NOTIFY.
            await conn.fetchval(SQL_S_UNLOCK_BARE, key, token)
            held = False  # it was ours (the caller checked); nobody was notified
        if token is None:
            known = [(lock_key(n), t) for n, t in self._tokens.items()]
            await conn.fetchval(
                SQL_S_DROP_TOKEN_LOCKS, [k for k, _ in known], [t for _, t in known]
            )
        return held

    def _forget(self, name: str) -> None:
        self._holders.pop(name, None)
        self._ttls.pop(name, None)
        self._tokens.pop(name, None)
        self._expires.pop(name, None)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        async with self._io:
            # Not ours on this session: lost already, or another local task's hold.
            if self._holders.get(name) != owner:
                return False
            if token is not None and self._tokens.get(name) != token:
                return False
            conn = self._conn
            if conn is None or conn.is_closed():
                return False
            try:
                held = await self._unlock(conn, name)
            except BaseException as exc:
                # Unknown whether the unlock ran: ending the session is the only sure way
                # to free the key (and it frees it now, not at some later ttl).
                self._broken(conn, exc)
                raise
            self._forget(name)
        if held is not None:
            self._wake_turn(name)
        return held is not None

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        # A permit is a row with an expiry in either mode (see .semaphore).
        from .semaphore import PostgresPermits

        return PostgresPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        from .rwlock import PostgresRW

        return PostgresRW(self, name)

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        # Fenced by the hold's token lock (as validate()): the owner is not on the server.
        args = (_name_bytes(name), lock_key(name), token, payload, keep * 1000.0)
        return (
            await self._record("record_put failed", "fetchval", SQL_S_RECORD_PUT, *args) is not None
        )

    async def validate(self, name: str, token: int) -> bool:
        ok = await self._run("validate failed", "fetchval", SQL_S_VALIDATE, lock_key(name), token)
        return bool(ok)

    async def names(self) -> list[str]:
        raise NotImplementedError(
            f"{self.display} (mode=session) cannot list lock names: its locks are advisory "
            "locks, which PostgreSQL knows only by a 64-bit hash of the name (pg_locks); "
            "use mode=lease to list them"
        )

    async def holder(self, name: str) -> Holder | None:
        key = lock_key(name)
        row = await self._run("holder failed", "fetchrow", SQL_S_HOLDER, key)
        assert row is not None
        pid, me = row
        if pid is None:
            return None
        owner = self._holders.get(name) if pid == me else None
        if owner is not None:
            return Holder(name, owner, self._tokens.get(name), None)
        # Another session (or one of our transactions): who it is, and its token.
        try:
            args = (key, pid, _TOKEN_SEARCH)
            who = await self._run("holder failed", "fetchrow", SQL_S_HOLDER_WHO, *args)
        except asyncpg.exceptions.InsufficientPrivilegeError:  # a role that may only look
            who = await self._run("holder failed", "fetchrow", SQL_S_HOLDER_SESSION, pid)
        assert who is not None
        return Holder(name, None, who["token"], None, detail=_session_detail(pid, who))

    async def break_lock(self, name: str) -> bool:
        key = lock_key(name)
        async with self._io:
            conn = await self._main()
            try:
                pid, me = await conn.fetchrow(SQL_S_HOLDER, key)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable("break_lock failed", exc) from exc
            if pid is None:
                return False
            if pid == me:  # our own session holds it: unlock it here, nothing else
                owner = self._holders.get(name)
                await self._unlock_or_end(conn, name)
                if owner is not None:
                    self._notify_lost(name, owner, "lock broken by break_lock()")
                self._wake_turn(name)
                return True
        # Another session: end it from a connection of our own, so that waiting for it to
        # exit never holds up this backend's renewals on the pinned connection.
        other = await self._connect(statement_cache_size=0)
        try:
            if self._idle_timeout:
                ended = await other.fetchval(SQL_S_BREAK, key, me, _BREAK_WAIT_MS)
            else:
                ended = await other.fetchval(SQL_S_BREAK_NOWAIT, key, me)
        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
            raise self._unavailable(
                "break_lock failed: ending the holder's session needs its role or "
                "pg_signal_backend",
                exc,
            ) from None
        except _CONNECTION_ERRORS as exc:
            raise self._unavailable("break_lock failed", exc) from exc
        finally:
            await _close(other)
        if ended is None:
            return False  # released (or already ending) meanwhile
        self._wake_turn(name)
        return True


#: How far back holder() looks for another session's token (tokens handed out).
_TOKEN_SEARCH = 100_000


def _session_detail(pid: int, who: Any) -> str:
    """``held by PostgreSQL session pid N (application 'x', client a.b.c.d, since T)``."""
    parts = []
    if who["application_name"]:
        parts.append(f"application {who['application_name']!r}")
    if who["client"]:
        parts.append(f"client {who['client']}")
    if who["backend_start"] is not None:
        parts.append(f"connected {who['backend_start']:%Y-%m-%d %H:%M:%S %Z}".rstrip())
    said = f" ({', '.join(parts)})" if parts else ""
    return f"held by PostgreSQL session pid {pid}{said}"


#: How long break_lock waits for the holder's session to exit (ms), so a successor's next
#: attempt finds the key free.
_BREAK_WAIT_MS = 5_000
