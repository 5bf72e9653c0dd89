"""Connecting, pooler detection, LISTEN/NOTIFY and the connection-slot error: what the
session and lease drivers share (:class:`PostgresDriver`, their base class)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs; see fence/sql.py Protocols

from ..._core.driver import Busy, Driver, ExtendResult, LeaseRef
from ..._core.errors import map_errors
from ..._core.exceptions import BackendUnavailable, ServerFull
from ..._core.holder import Holder
from ..._core.turns import LINE_POLL, Turns
from ..._core.validation import check_seconds
from .._common.asyncio_only import require_asyncio
from .io_lock import IOLock
from .records import PostgresRecords
from .refusals import _LOCK_TABLE_FULL as _LOCK_TABLE_FULL
from .refusals import no_slot, table_full
from .tokens import ensure_schema, notify_channel, waiter_key

if TYPE_CHECKING:
    from .claims import PostgresClaimStore

logger = logging.getLogger("asynclock.postgres")

MODES = ("session", "lease")

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
)


class PoolerDetected(BackendUnavailable):
    """Session advisory locks were refused: the URL goes through a transaction pooler."""


class PostgresDriver(PostgresRecords, Driver):
    """What both modes share: the pinned connection, the LISTEN connection, pooler
    detection. :class:`~asynclock.backends.postgres.SessionDriver` (``mode="session"``)
    and :class:`~asynclock.backends.postgres.LeaseDriver` (``mode="lease"``) are the
    drivers (``asynclock.connect`` picks one from ``?mode=``); this base is not one."""

    #: Statements wait for the pinned connection (io_lock); acquire sets SENT_AT.
    queues_locally = True

    remote = True  # every acquire and release is a server round trip
    #: Every release (and every NOTIFY heard) wakes only the head of the name's local line
    #: (:meth:`_wake_turn`): the core need not wake every waiter of the name.
    wakes_waiters = True

    #: What the pinned connection carries (in the connection-slot error).
    _carries = "its locks"
    #: Does this mode work through a transaction pooler?
    _pooler_ok = False
    mode = "session"
    #: Mode session's local owner of each name it holds (set by SessionDriver only).
    _holders: dict[str, str]

    def __init__(
        self,
        dsn: str,
        *,
        mode: str | None = None,
        poll: float = 0.2,
        connect_timeout: float = 10.0,
        check_pooler: bool = True,
        display: str | None = None,
        password: str | None = None,
    ) -> None:
        if type(self) is PostgresDriver:
            raise TypeError(
                "PostgresDriver is the base of SessionDriver and LeaseDriver, not a driver: "
                "use asynclock.connect('postgresql://...?mode=session|lease') or one of them"
            )
        super().__init__()
        require_asyncio("the postgresql:// backend", "asyncpg")
        if mode is not None and mode not in MODES:
            raise ValueError(f"postgres mode must be 'session' or 'lease', got {mode!r}")
        if mode is not None and mode != self.mode:
            raise ValueError(f"{type(self).__name__} is mode {self.mode!r}, got mode={mode!r}")
        self.dsn = dsn
        self.poll = check_seconds(poll, "poll", text=True)
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout", text=True)
        self.check_pooler = check_pooler
        self.display = display or "postgresql://"
        self._errors = map_errors(self.display, password)
        self._conn: asyncpg.Connection | None = None
        self._listen_conn: asyncpg.Connection | None = None
        # asyncio locks (asyncpg is asyncio-only): unlike anyio.Lock they do not yield
        # to the event loop when uncontended, which is most of a lock cycle's budget.
        self._io = IOLock()  # renewals first (`async with self._io.first`): see io_lock
        self._listen_io = asyncio.Lock()
        self._idle_set: str | None = None  # idle_session_timeout now set on the session
        self._closed = False
        self._pooled = False  # a transaction pooler sits in front (mode lease only)
        self._idle_timeout = True  # server has idle_session_timeout (PostgreSQL >= 14)
        # LISTEN bookkeeping: channel -> {name: number of watchers}.
        self._channels: dict[str, dict[str, int]] = {}
        # Channels LISTENed to, with their waiter key held, on the current listener.
        self._announced: set[str] = set()
        # This process's blocking waiters per name, first come first served: PostgreSQL
        # keeps no queue, and without one the task that just released wins every race.
        # Only the head asks the server; the others are woken one at a time (no herd).
        self._queues = Turns()
        # The claims tables used (claims.py): each is the keeper of its claimed rows.
        self._claim_stores: dict[tuple[object, ...], PostgresClaimStore] = {}

    def __repr__(self) -> str:
        return f"<PostgresDriver {self.display} mode={self.mode}>"

    # -- connections -----------------------------------------------------------------------

    def _unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        return self._errors.unavailable(what, exc)

    async def _connect(self, *, statement_cache_size: int = 100) -> asyncpg.Connection:
        parts = urlsplit(self.dsn)
        settings = {}
        if "application_name" not in dict(parse_qsl(parts.query)):
            settings["application_name"] = "asynclock"
        try:
            conn: asyncpg.Connection = await asyncpg.connect(
                self.dsn,
                timeout=self.connect_timeout,
                statement_cache_size=statement_cache_size,
                server_settings=settings,
            )
        except asyncpg.exceptions.InvalidPasswordError as exc:
            raise self._unavailable(
                "authentication failed (check user and password)", exc
            ) from None
        except asyncpg.exceptions.InvalidAuthorizationSpecificationError as exc:
            raise self._unavailable("not authorised", exc) from None
        except asyncpg.exceptions.InvalidCatalogNameError as exc:
            raise self._unavailable("database does not exist", exc) from None
        except asyncpg.exceptions.TooManyConnectionsError as exc:
            raise self._no_slot(exc) from None
        except (TimeoutError, OSError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        except (asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise self._unavailable("cannot connect", exc) from None
        return conn

    def _no_slot(self, exc: BaseException) -> BackendUnavailable:
        """The server has no connection slot for us (SQLSTATE 53300)."""
        return no_slot(self.display, self._carries, self._errors.scrub(str(exc)))

    # -- local turns -------------------------------------------------------------------------
    # A token scope (``acquire(..., scope=)``) needs nothing in either mode: one sequence
    # (above the durable epoch) orders every token of every name and mode, so a scope's
    # tokens already rise (G2).

    def _not_your_turn(self, name: str, owner: str, queue: bool) -> Busy | None:
        """Busy (no round trip) while a task of this process that waited longer is queued
        for ``name``; a blocking ``owner`` joins the queue (and is woken when its turn
        comes: see :meth:`_took_turn`, :meth:`abandon`)."""
        turns = self._queues
        if not turns.behind(name, owner):
            return None
        if queue:
            turns.join(name, owner)
            return Busy(LINE_POLL)
        return Busy(self.poll)

    def _took_turn(self, name: str, owner: str, queue: bool, result: int | Busy) -> int | Busy:
        """After a server attempt: a grant leaves the queue, a busy blocking one joins it."""
        if not isinstance(result, Busy):
            head = self._queues.leave(name, owner)
            if head is not None:
                # Its turn: one attempt tells it how long the new holder has (a holder
                # that dies sends no NOTIFY), then it sleeps until a release wakes it.
                self._wake(name, head)
        elif queue:
            self._queues.join(name, owner)
        return result

    async def abandon(self, name: str, owner: str) -> None:
        head = self._queues.leave(name, owner)
        if head is not None:
            self._wake(name, head)  # the head left: the next waiter's turn

    def _wake_turn(self, name: str) -> None:
        """``name`` may be free: wake the head of its line here (only it asks the server),
        or every waiter of ``name`` if it has no line (a semaphore's or read-write lock's
        wake name: see ``_core/wakes.py``)."""
        head = self._queues.head(name)
        if head is not None:
            self._wake(name, head)
        else:
            self._wake(name)

    async def open(self) -> None:
        require_asyncio(self.display, "asyncpg")
        self._closed = False
        conn = await self._open_main()
        self._conn = conn
        conn.add_termination_listener(self._on_main_terminated)

    async def _open_main(self) -> asyncpg.Connection:
        self._idle_set = None
        conn = await self._connect(statement_cache_size=0 if self._pooled else 100)
        try:
            if self.check_pooler and not self._pooled:
                pooled = await self._probe_pooler(conn)
                if pooled and not self._pooler_ok:
                    raise PoolerDetected(
                        f"{self.display}: this URL goes through a transaction-mode pooler "
                        f"(PgBouncer pool_mode=transaction, RDS Proxy, ...): {pooled}. "
                        "Session advisory locks would stay on a server session that the pooler "
                        "hands to other clients, so they could leak or be shared. Connect "
                        "directly to PostgreSQL or through a session-mode pool, or use the "
                        "lease table: add ?mode=lease to the URL."
                    )
                if pooled:
                    logger.info("%s: transaction pooler detected: %s", self.display, pooled)
                    self._pooled = True
                    await _close(conn)
                    await self._close_listener()
                    conn = await self._connect(statement_cache_size=0)
            version = int(await conn.fetchval("SELECT current_setting('server_version_num')"))
            self._idle_timeout = version >= 140000
            await ensure_schema(conn, mode=self.mode)
        except BaseException:
            await _close(conn)
            raise
        return conn

    async def _probe_pooler(self, conn: asyncpg.Connection) -> str | None:
        """Evidence of a transaction pooler, or None.

        Two client connections that are open at the same time must be two server sessions
        (different ``pg_backend_pid()``), and one connection must keep its pid. Behind a
        transaction pooler the second connection is usually handed the first one's idle
        server session (PgBouncer reuses the most recent one), and one client's pid can
        change between transactions. The heartbeat's ``pg_locks`` check by pid catches any
        case this probe misses, as a lost lease.
        """
        probe = await self._listener()
        try:
            first = await conn.fetchval("SELECT pg_backend_pid()")
            other = await probe.fetchval("SELECT pg_backend_pid()")
            again = await conn.fetchval("SELECT pg_backend_pid() AS again")
        except (
            asyncpg.exceptions.DuplicatePreparedStatementError,
            asyncpg.exceptions.InvalidSQLStatementNameError,
        ) as exc:
            return f"prepared statements vanished or collided between transactions ({exc})"
        if other == first:
            return f"two client connections shared one server session (pid {first})"
        if again != first:
            return f"one client connection moved from server pid {first} to {again}"
        return None

    async def _main(self) -> asyncpg.Connection:
        """The pinned connection; reconnect lazily after a loss (call with ``_io`` held)."""
        if self._closed:
            raise BackendUnavailable(f"{self.display}: the backend is closed")
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        if conn is not None:
            self._on_main_terminated(conn)
        conn = await self._open_main()
        self._conn = conn
        conn.add_termination_listener(self._on_main_terminated)
        return conn

    def _on_main_terminated(self, conn: Any) -> None:
        if conn is not self._conn and self._conn is not None:
            return
        self._conn = None
        self._lose_all("the PostgreSQL connection carrying the session lock was closed")

    def _lose_all(self, reason: str) -> None:
        """The pinned connection is gone: every hold it carried is lost (mode session)."""

    def _forget_all(self) -> None:
        """Drop what this backend knows of its holds (at close)."""

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        self._forget_all()
        if conn is not None:
            await _close(conn)
        await self._close_listener()

    def _table_full(self, what: str, exc: BaseException) -> ServerFull:
        return table_full(self.display, what, exc)

    async def _run(self, what: str, fetch: str, sql: str, *args: Any, first: bool = False) -> Any:
        """``conn.<fetch>(sql, *args)`` on the pinned connection, a lost connection as
        BackendUnavailable("<display>: <what>: ...") (not for the hot path: getattr).
        ``first``: a renewal, ahead of the statements queued (see :mod:`.io_lock`)."""
        io = self._io
        if not io.take():  # `async with self._io` (or `.first`), without its coroutines
            await io.acquire(first)
        try:
            conn = self._conn
            if conn is None or self._closed or conn.is_closed():
                conn = await self._main()
            try:
                return await getattr(conn, fetch)(sql, *args)
            except _CONNECTION_ERRORS as exc:
                raise self._unavailable(what, exc) from exc
            except _LOCK_TABLE_FULL as exc:
                raise self._table_full(what, exc) from None
            except asyncpg.exceptions.InternalClientError as exc:
                # The connection's protocol is out of step with the server ("cannot
                # switch to state ..."; seen after this process was frozen mid-call):
                # unusable, so closed; the next call makes a new one.
                conn.terminate()
                raise self._unavailable(what, exc) from exc
        finally:
            io.release()

    async def _raw_fetchval(self, sql: str, *args: Any) -> Any:
        """Run raw SQL on the pinned session (tests use it to sabotage a lock)."""
        async with self._io:
            return await (await self._main()).fetchval(sql, *args)

    # -- LISTEN ------------------------------------------------------------------------------

    async def _listener(self) -> asyncpg.Connection:
        conn = self._listen_conn
        if conn is None or conn.is_closed():
            conn = await self._connect(statement_cache_size=0)
            conn.add_termination_listener(self._on_listener_terminated)
            self._listen_conn = conn
            self._announced = set()
            for channel, names in list(self._channels.items()):
                await self._announce(conn, channel, next(iter(names)))
        return conn

    async def _announce(self, conn: asyncpg.Connection, channel: str, name: str) -> None:
        """LISTEN on ``channel``, then hold ``name``'s waiter key shared on the listener
        connection, so that releases of ``name`` NOTIFY (call with ``_listen_io`` held, or
        from :meth:`_listener`). The order matters: a release that sees the waiter key
        notifies a channel already listened to; one that does not see it unlocked before
        the key was taken, so the waiter's next try (right after :meth:`watch`) finds
        the lock free."""
        if channel in self._announced:
            return
        await conn.add_listener(channel, self._on_notify)
        high, low = waiter_key(name)  # ints: safe to inline (simple protocol, one trip)
        await conn.execute(f"SELECT pg_advisory_lock_shared({high}, {low})")
        self._announced.add(channel)

    async def _unannounce(self, conn: asyncpg.Connection, channel: str, name: str) -> None:
        if channel not in self._announced:
            return
        self._announced.discard(channel)
        high, low = waiter_key(name)
        await conn.execute(f"SELECT pg_advisory_unlock_shared({high}, {low})")
        await conn.remove_listener(channel, self._on_notify)

    def _on_listener_terminated(self, conn: Any) -> None:
        if conn is self._listen_conn:
            self._listen_conn = None
            self._announced = set()

    async def _close_listener(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        self._announced = set()
        if conn is not None:
            await _close(conn)

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for name in list(self._channels.get(channel, ())):
            self._wake_turn(name)

    async def watch(self, name: str, cursor: object = None) -> bool:
        if self._pooled:
            return False  # LISTEN does not work through a transaction pooler: poll instead
        channel = notify_channel(name)
        names = self._channels.setdefault(channel, {})
        names[name] = names.get(name, 0) + 1
        if len(names) > 1 or names[name] > 1:
            return True
        try:
            async with self._listen_io:
                conn = await self._listener()
                if channel in self._channels:
                    await self._announce(conn, channel, name)
        except Exception as exc:  # polling still works; a waiter just hears later
            logger.warning("%s: LISTEN failed, waiters will poll: %r", self.display, exc)
        return True

    async def unwatch(self, name: str) -> None:
        channel = notify_channel(name)
        names = self._channels.get(channel)
        if names is None or name not in names:
            return
        names[name] -= 1
        if names[name] > 0:
            return
        del names[name]
        if names:
            return
        del self._channels[channel]
        conn = self._listen_conn
        if conn is None or conn.is_closed():
            return
        try:
            async with self._listen_io:
                if channel not in self._channels:
                    await self._unannounce(conn, channel, name)
        except Exception as exc:
            logger.debug("%s: UNLISTEN failed: %r", self.display, exc)

    # -- primitives ----------------------------------------------------------------------

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        """Renew locks (the mode's own statement)."""
        return await self._extend_locks(leases)

    async def _extend_locks(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        raise NotImplementedError

    async def hold_names(self) -> tuple[list[str], list[str]]:
        from .semaphore import hold_names  # (it imports this module)

        return await hold_names(self)

    async def claim_holder(self, name: str) -> Holder | None:
        from .claim_holder import claim_holder

        return await claim_holder(self, name)

    def claim_store(
        self,
        table: str,
        *,
        where: str | None = None,
        order_by: str | None = None,
        id_column: str = "id",
        schema: str | None = None,
    ) -> PostgresClaimStore:
        """``backend.claims(table, ...)``'s statements (see :mod:`.claims`): one store per
        table, id column and claim conditions, so a renewal call carries all its rows."""
        from .claims import PostgresClaimStore

        key = (table, where, order_by, id_column, schema)
        store = self._claim_stores.get(key)
        if store is None:
            store = PostgresClaimStore(
                self, table, where=where, order_by=order_by, id_column=id_column, schema=schema
            )
            self._claim_stores[key] = store
        else:
            store.recheck()  # a new claims object checks the table's columns again
        return store


async def _close(conn: asyncpg.Connection) -> None:
    try:
        with anyio.fail_after(2):
            await conn.close()
    except BaseException:
        conn.terminate()
