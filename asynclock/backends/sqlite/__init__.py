"""``sqlite:///path`` — the embedded default: processes on one host share locks via one file.

* WAL journal. Every statement runs on the event loop's own thread (a thread hop per call
  costs more than the SQL itself). When another process holds the write lock we do not
  block the loop in SQLite's busy handler: we yield and retry with a short jittered
  backoff, for at most ``busy_timeout`` seconds.
* An uncontended acquire is one statement (an upsert that only takes a free row) and a
  release is one statement (an owner-checked update). The token lives in the lease row and
  is bumped in place; rows are never deleted, so release, expiry and a ``kill -9`` never
  reset it (G2).
* Expiry is on ``CLOCK_MONOTONIC`` (system-wide on Linux), tagged with the kernel's boot id
  so rows written before a reboot count as expired.
* Waiters queue in a table (first come, first served) and refresh their place on each
  attempt; a waiter that stops asking (process gone) drops out after ``WAITER_TTL``. On
  Linux each backend listens on an abstract Unix datagram socket named in its queue rows,
  and a release sends one datagram to the head waiter, so handoff across processes does
  not wait for a poll; the waiters behind the head sleep until woken, and one statement
  per backend keeps their places (see :mod:`.waking`: no herd). Elsewhere waiters poll
  with a short backoff.

URL: ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``; options
``?synchronous=normal|full`` (default normal: survives process crashes; ``full`` also
survives power loss, at an fsync per transaction) and ``?busy_timeout=SECONDS`` (5).
"""

from __future__ import annotations

import math
import os
import random
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import anyio

from ..._core.driver import Busy, ExtendResult, LeaseRef, Refused
from ..._core.errors import map_errors
from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from ..._core.turns import LINE_POLL, Turns
from ..._core.validation import check_seconds
from .._common.options import Options
from .host import boot_id, wake_socket
from .records import Records
from .rwlock import SQLiteRW
from .semaphore import SQLitePermits, hold_names
from .sql import (
    SCHEMA,
    SCHEMA_VERSION,
    SQL_AHEAD,
    SQL_BREAK,
    SQL_EXTEND,
    SQL_FORGET_WAITER,
    SQL_GRANT,
    SQL_HEAD,
    SQL_LIVE,
    SQL_PRUNE_WAITERS,
    SQL_QUEUE,
    SQL_RELEASE,
    SQL_SCOPE_NEXT,
    SQL_SET_TOKEN,
    SQL_TRY,
)
from .waiting import BEHIND_POLL, MAX_POLL, _is_busy, _Waiting
from .waiting import WAITER_TTL as WAITER_TTL
from .waking import Waking

T = TypeVar("T")


class SQLiteDriver(Records, Waking):
    """Leases in one SQLite file shared by every process that opens it."""

    #: A release wakes the head waiter only (``Waking._wake_head``), not every local one.
    wakes_waiters = True

    def __init__(self, path: str, *, synchronous: str = "normal", busy_timeout: float = 5) -> None:
        super().__init__()
        if synchronous.lower() not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        self.path = path
        self.synchronous = synchronous.upper()
        self.busy_timeout = check_seconds(busy_timeout, "busy_timeout", text=True)
        self.display = f"sqlite:///{path}"
        self._errors = map_errors(self.display)
        self.boot = boot_id()
        self._db: sqlite3.Connection | None = None
        self._queued: set[tuple[str, str]] = set()
        self._seen: dict[tuple[str, str], _Waiting] = {}
        #: This backend's waiting tasks, a line per name: only the first of a line asks
        #: the file and has a queue row (see :meth:`acquire`).
        self._turns = Turns()
        #: When each of them began to wait: its place in the file's queue (SQL_QUEUE).
        self._arrived: dict[tuple[str, str], float] = {}
        self._commits = 0  # our own commits: PRAGMA data_version only counts others'
        self._sock: socket.socket | None = None
        self._address: str | None = None
        self._init_waking()
        self._pruned_at = -math.inf

    # -- plumbing --------------------------------------------------------------------------

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise BackendUnavailable(f"{self.display}: the backend is closed")
        return self._db

    async def _retry_busy(self, fn: Callable[[], T], what: str) -> T:
        """Call ``fn`` until it does not hit a locked database, yielding between tries."""
        give_up = time.monotonic() + self.busy_timeout
        delay = 0.0001
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise self._errors.unavailable(f"{what} failed", exc) from exc
                if time.monotonic() >= give_up:
                    raise BackendUnavailable(
                        f"{self.display}: {what}: the database stayed locked for "
                        f"{self.busy_timeout:g}s (busy_timeout); another process holds a "
                        "write transaction"
                    ) from exc
            except sqlite3.Error as exc:
                raise self._errors.unavailable(f"{what} failed", exc) from exc
            await anyio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.005)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one BEGIN IMMEDIATE transaction; retry (async) while busy."""

        def transaction() -> T:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            self._commits += 1
            return result

        return await self._retry_busy(transaction, "transaction")

    def _try_statement(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor | None:
        """One statement in its own (implicit) transaction, tried once: None if busy."""
        db = self._db
        if db is None:
            return None  # the retrying path raises the "closed" error
        try:
            cursor = db.execute(sql, args)
        except sqlite3.OperationalError as exc:
            if _is_busy(exc):
                return None
            raise self._errors.unavailable("statement failed", exc) from exc
        except sqlite3.Error as exc:
            raise self._errors.unavailable("statement failed", exc) from exc
        self._commits += 1
        return cursor

    async def _statement(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Cursor:
        """One statement in its own (implicit) transaction; retry while busy."""

        def run() -> sqlite3.Cursor:
            cursor = self.db.execute(sql, args)
            self._commits += 1
            return cursor

        return await self._retry_busy(run, "statement")

    def _version(self) -> tuple[int, int]:
        """Changes anyone committed to the file since we last looked (cheap: shared memory)."""
        return (self.db.execute("PRAGMA data_version").fetchone()[0], self._commits)

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if os.path.isdir(self.path):  # noqa: ASYNC240 - a stat, once, at open
            raise BackendUnavailable(
                f"cannot use {self.path!r} as a SQLite lock file: it is a directory; "
                "give a file path like sqlite:///locks.db"
            )
        try:
            db = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=0
            )
        except sqlite3.Error as exc:
            raise BackendUnavailable(
                f"cannot open SQLite lock file {self.path!r}: {exc} "
                "(the directory must exist and be writable by this process)"
            ) from exc
        self._db = db
        try:
            await self._retry_busy(self._prepare, "open")
            await self._write(self._create_schema)
        except BaseException:
            self._db = None
            db.close()
            raise
        wake = wake_socket()
        if wake is not None:
            self._sock, self._address = wake

    def _prepare(self) -> None:
        db = self.db
        db.execute("PRAGMA busy_timeout = 0")
        # Switching to WAL needs a moment of exclusive access; skip it when already WAL.
        mode = str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower()
        if mode != "wal":
            mode = str(db.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
        if mode != "wal":
            raise BackendUnavailable(
                f"{self.display}: could not switch to WAL journal mode (got {mode!r}); "
                "SQLite locks need a local file system"
            )
        db.execute(f"PRAGMA synchronous = {self.synchronous}")

    def _create_schema(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise BackendUnavailable(
                f"{self.display}: lock file has schema version {version}; this asynclock "
                f"understands version {SCHEMA_VERSION} (upgrade asynclock or use a new file)"
            )
        for statement in SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    async def aclose(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # -- primitives ------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        """One attempt. A blocking waiter joins this backend's line for ``name`` first:
        while another task of this backend waited longer it is Busy without asking the
        file (it is woken when its turn comes), so the file's queue holds one row per
        backend and name however many of its tasks wait (issue 45 item 5: 10,000 waiters
        in 10 processes each wrote a row and fought over the write lock for it)."""
        if not queue:
            return await self._attempt(name, owner, ttl, queue, scope)
        key = (name, owner)
        turns = self._turns
        if key not in self._arrived:
            self._arrived[key] = time.monotonic()
            turns.join(name, owner)
        if turns.behind(name, owner):
            return Busy(LINE_POLL)
        result = await self._attempt(name, owner, ttl, queue, scope)
        if not isinstance(result, Busy):
            del self._arrived[key]
            self._next_turn(name, turns.leave(name, owner))
        return result

    async def _attempt(
        self, name: str, owner: str, ttl: float, queue: bool, scope: str | None
    ) -> int | Busy:
        boot = self.boot
        key = (name, owner)
        now = time.monotonic()
        if scope is not None and not queue:
            return await self._write(lambda db: self._try_scoped(db, name, owner, ttl, scope))
        if scope is None and key not in self._queued:
            args = (name, owner, now + ttl, boot, now)
            cursor = self._try_statement(SQL_TRY, args) or await self._statement(SQL_TRY, args)
            row = cursor.fetchone()
            if row is not None:
                return int(row[0])
            if not queue:
                live = self.db.execute(SQL_LIVE, (name, boot, time.monotonic())).fetchone()
                if live is None:
                    return Busy(MAX_POLL)
                return Busy(float(live[2]) - time.monotonic(), owner=str(live[0]))
        seen = self._seen.get(key)
        if seen is not None and seen.waits_turn():
            return Busy(BEHIND_POLL)  # its turn comes with a wake-up (see waking.py)
        if (
            seen is not None
            and now < seen.until
            and now - seen.refreshed < WAITER_TTL / 3
            and self._version() == seen.version
        ):
            # Nothing committed since our last failed attempt (by another process, or by
            # us) and the holder's lease has not run out: skip the write transaction.
            seen.attempts += 1
            return Busy(seen.delay(now))

        def attempt(db: sqlite3.Connection) -> int | Busy:
            now = time.monotonic()
            live = db.execute(SQL_LIVE, (name, boot, now)).fetchone()
            if live is None:
                head = db.execute(SQL_HEAD, (name, boot, now)).fetchone()
                if head is None or head[0] == owner:
                    token: int = db.execute(SQL_GRANT, (name, owner, now + ttl, boot)).fetchone()[0]
                    if scope is not None:
                        token = self._scope_token(db, name, token, scope)
                    db.execute(SQL_FORGET_WAITER, key)
                    handed.append(self._queue_next(db, name, now))
                    return token
            expires = now if live is None else float(live[2])
            place = self._arrived.get(key, now)
            db.execute(SQL_QUEUE, (name, owner, now + WAITER_TTL, boot, self._address, place))
            ahead: int = db.execute(SQL_AHEAD, (name, boot, now, name, owner)).fetchone()[0]
            wait = self._seen.get(key) or _Waiting(notified=self._address is not None)
            wait.until, wait.refreshed, wait.ahead, wait.woken = expires, now, ahead, False
            # We hold the write lock: nobody else commits before our COMMIT (+1 below).
            wait.version = (db.execute("PRAGMA data_version").fetchone()[0], self._commits + 1)
            self._seen[key] = wait
            return Busy(wait.delay(now))

        handed: list[tuple[str, str] | None] = []
        result = await self._write(attempt)
        self._handed(handed)
        if isinstance(result, Busy):
            self._queued.add(key)
            self._queued_one()
        else:
            self._queued.discard(key)
            self._seen.pop(key, None)
        return result

    def _scope_token(self, db: sqlite3.Connection, name: str, token: int, scope: str) -> int:
        """Inside the grant's transaction: the token above both the name's and the scope's."""
        scoped: int = db.execute(SQL_SCOPE_NEXT, (scope, token)).fetchone()[0]
        if scoped != token:
            db.execute(SQL_SET_TOKEN, (scoped, name))
        return scoped

    def _try_scoped(
        self, db: sqlite3.Connection, name: str, owner: str, ttl: float, scope: str
    ) -> int | Busy:
        """A non-blocking attempt with a token scope: take the name only if it is free and
        nobody is queued for it (as SQL_TRY does), never joining the queue."""
        boot, now = self.boot, time.monotonic()
        live = db.execute(SQL_LIVE, (name, boot, now)).fetchone()
        if live is not None:
            return Busy(float(live[2]) - now, owner=str(live[0]))
        if db.execute(SQL_HEAD, (name, boot, now)).fetchone() is not None:
            return Busy(MAX_POLL)
        token: int = db.execute(SQL_GRANT, (name, owner, now + ttl, boot)).fetchone()[0]
        return self._scope_token(db, name, token, scope)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        boot = self.boot

        def renew(db: sqlite3.Connection) -> list[ExtendResult]:
            now = time.monotonic()
            out: list[ExtendResult] = []
            for ref in leases:
                cur = db.execute(
                    SQL_EXTEND, (now + ref.ttl, ref.name, ref.owner, ref.token, boot, now)
                )
                out.append(True if cur.rowcount == 1 else Refused("lease row gone or taken over"))
            return out

        return await self._write(renew)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        args = (name, owner, token, self.boot, time.monotonic())
        cursor = self._try_statement(SQL_RELEASE, args) or await self._statement(SQL_RELEASE, args)
        row = cursor.fetchone()
        if row is None:
            return False
        if row[1] is not None:
            self._wake_head(name, row[0], row[1])
        return True

    async def validate(self, name: str, token: int) -> bool:
        try:
            row = self.db.execute(SQL_LIVE, (name, self.boot, time.monotonic())).fetchone()
        except sqlite3.Error as exc:
            raise self._errors.unavailable("validate failed", exc) from exc
        return row is not None and row[1] == token

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        return SQLitePermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        return SQLiteRW(self, name)

    async def hold_names(self) -> tuple[list[str], list[str]]:
        return await hold_names(self)

    async def abandon(self, name: str, owner: str) -> None:
        key = (name, owner)
        self._arrived.pop(key, None)
        try:
            await self._forget(name, owner)
        finally:
            self._next_turn(name, self._turns.leave(name, owner))

    async def _forget(self, name: str, owner: str) -> None:
        key = (name, owner)
        seen = self._seen.pop(key, None)
        if key not in self._queued:
            return
        self._queued.discard(key)
        boot, now = self.boot, time.monotonic()
        # Pruning looks at every row: once per WAITER_TTL, not once per waiter leaving
        # (a thousand cancelled at once would each scan the thousand).
        prune = now - self._pruned_at >= WAITER_TTL
        if prune:
            self._pruned_at = now

        def forget(db: sqlite3.Connection) -> None:
            db.execute(SQL_FORGET_WAITER, key)
            if prune:
                db.execute(SQL_PRUNE_WAITERS, (now, boot))
            handed.append(self._queue_next(db, name, now))

        self._gone.add(key)  # if the delete does not happen, the place keeper's does
        handed: list[tuple[str, str] | None] = []
        await self._write(forget)
        self._handed(handed)
        self._gone.discard(key)
        # If we were first in line, the next waiter may go now (one behind the head that
        # leaves changes nothing for the others: no wake-up).
        if seen is None or seen.ahead == 0 or seen.woken:
            self._notify_next(name)

    async def names(self) -> list[str]:
        try:
            rows = self.db.execute("SELECT name FROM asynclock_lease").fetchall()
        except sqlite3.Error as exc:
            raise self._errors.unavailable("listing names failed", exc) from exc
        return [str(row[0]) for row in rows]

    async def holder(self, name: str) -> Holder | None:
        try:
            row = self.db.execute(SQL_LIVE, (name, self.boot, time.monotonic())).fetchone()
        except sqlite3.Error as exc:
            raise self._errors.unavailable("holder failed", exc) from exc
        if row is None:
            return None
        # CLOCK_MONOTONIC is system-wide on Linux: the same clock every process's rows use.
        left = max(0.0, float(row[2]) - time.monotonic())
        return Holder(name, str(row[0]), int(row[1]), left)

    async def break_lock(self, name: str) -> bool:
        args = (name, self.boot, time.monotonic())
        cursor = self._try_statement(SQL_BREAK, args) or await self._statement(SQL_BREAK, args)
        row = cursor.fetchone()
        if row is None:
            return False
        if row[1] is not None:
            self._send_wake(name, row[0], row[1])
        self._wake_waiter(name, None)
        return True


#: The options of sqlite:// (URL query and keywords alike).
OPTIONS = Options("sqlite", ("synchronous", "busy_timeout"), ("synchronous", "busy_timeout"))


def driver_from_url(url: str, **options: Any) -> SQLiteDriver:
    parts = urlsplit(url)
    if parts.netloc:
        raise ValueError(
            f"sqlite URL must have no host: use sqlite:///relative.db or sqlite:////abs.db, "
            f"got host {parts.netloc!r}"
        )
    path = unquote(parts.path[1:]) if parts.path.startswith("/") else unquote(parts.path)
    if not path or path == ":memory:":
        raise ValueError(
            "sqlite URL needs a file path (sqlite:///locks.db or sqlite:////abs/locks.db); "
            "for in-process locks use memory://"
        )
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    OPTIONS.check(pairs, options)
    query: dict[str, Any] = {**dict(pairs), **options}
    return SQLiteDriver(os.fspath(path), **query)
