"""The Redis connection: commands packed by hand, replies read under deadlines, and one
node's idle connections (the pub/sub listener is :mod:`.pubsub`).

redis-py's private API is used here only (see ``Wire``) and checked by
``tests/backends/test_redis_wire.py``."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from ..._core.errors import map_errors
from ..._core.exceptions import BackendUnavailable
from .deadlines import Deadlines
from .options import NodeURL
from .pipeline import MAX_CALLS, Pipelined
from .pipeline import drop_connection as drop_connection
from .scripts import LAZY, SCRIPTS, SHAS

_hiredis: Any
try:  # optional, as for redis-py: replies are parsed in C when it is there
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - depends on the environment
    _hiredis = None

logger = logging.getLogger("asynclock.redis")


def ms(seconds: float) -> int:
    """Seconds to whole milliseconds, rounded up (a server ttl never shorter than asked)."""
    return max(1, math.ceil(seconds * 1000))


# -- one server -----------------------------------------------------------------------------


#: ``b"$<n>"`` for the sizes most arguments have and ``b"*<n>"`` for argument counts,
#: looked up instead of formatted: bytes %-formatting was most of the cost of packing.
_SIZES = [b"$%d" % n for n in range(1024)]
_COUNTS = [b"*%d" % n for n in range(64)]
_NUMBERS = [b"%d" % n for n in range(64)]  # a script's number of keys


def pack(*args: bytes) -> bytes:
    """One command in the Redis protocol (RESP). Every command the drivers send on their
    command connections goes through here (benchmarks count commands at this point)."""
    try:
        parts = [_COUNTS[len(args)]]
        for arg in args:
            parts.append(_SIZES[len(arg)])
            parts.append(arg)
    except IndexError:  # a long argument (a script's text) or very many of them
        parts = [b"*%d" % len(args)]
        for arg in args:
            parts.append(b"$%d" % len(arg))
            parts.append(arg)
    parts.append(b"")
    return b"\r\n".join(parts)


#: Idle command connections a node keeps open (more are opened while calls overlap).
MAX_IDLE_CONNECTIONS = 256


def _no_client_info() -> dict[str, Any]:
    """Connection keywords that turn redis-py's ``CLIENT SETINFO`` off: ``driver_info=None``
    (redis-py >= 7), else ``lib_name=None, lib_version=None`` (redis-py 5 and 6)."""
    params = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in params:
        return {"driver_info": None}
    if "lib_name" in params:
        return {"lib_name": None, "lib_version": None}
    return {}  # pragma: no cover - older than redis-py 5: it sends no CLIENT SETINFO


_NO_CLIENT_INFO = _no_client_info()


def _reply_error(message: str) -> redis.exceptions.ResponseError:
    """An error reply as the exception redis-py raises for it (NOSCRIPT matters: the
    script is loaded again)."""
    if message.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(message)
    return redis.exceptions.ResponseError(message)


class Wire:
    """A command connection (redis-py's: connect, AUTH/ACL, TLS, ``SELECT``) and the way
    its replies are read.

    The lean path writes to the connection's ``asyncio.StreamWriter`` and parses replies
    from its ``asyncio.StreamReader`` with a ``hiredis.Reader`` of its own (redis-py's
    private ``_writer`` and ``_reader``, present since redis-py 4.2; redis-py's parser is
    never touched). Each command is read to the end of its reply, and a RESP2 server sends
    nothing unasked on a command connection, so no bytes are ever left in either parser.
    Without hiredis, without the streams, or on RESP3 (push messages), the public
    ``send_packed_command`` and ``read_response`` are used.
    """

    __slots__ = ("conn", "parser", "stream", "writer")

    def __init__(self, conn: AbstractConnection) -> None:
        self.conn = conn
        writer = getattr(conn, "_writer", None)
        stream = getattr(conn, "_reader", None)
        self.writer = writer if isinstance(writer, asyncio.StreamWriter) else None
        self.stream: asyncio.StreamReader | None = None
        self.parser: Any = None
        if (
            _hiredis is not None
            and self.writer is not None
            and isinstance(stream, asyncio.StreamReader)
            and getattr(conn, "protocol", None) == 2
        ):
            self.stream = stream
            self.parser = _hiredis.Reader(replyError=_reply_error)

    async def read(self) -> Any:
        """The next reply; an error reply raises (redis-py's exceptions either way)."""
        parser, stream = self.parser, self.stream
        if parser is None or stream is None:
            return await self.conn.read_response()
        reply = parser.gets()
        while reply is False:
            try:
                data = await stream.read(65536)
            except OSError as exc:
                raise redis.exceptions.ConnectionError(f"error reading a reply: {exc!r}") from exc
            if not data:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            parser.feed(data)
            reply = parser.gets()
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply


def _resp2(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection keywords for RESP2. Maintenance notifications need RESP3 or hiredis, and
    a RESP2 connection may use the pure-Python parser, so they are turned off (redis-py
    >= 7 passes them)."""
    out = {**kwargs, "protocol": 2}
    for key in ("maint_notifications_config", "maint_notifications_pool_handler"):
        if key in out:
            out[key] = None
    return out


class Spawned:
    """Bare asyncio tasks for the nodes of one Redlock request that must connect first.

    Not an anyio task group, for speed (measured, anyio 4.16, shared 2-core machine): a
    fan-out whose 3 nodes connect costs ~18-23 µs of CPU in bare tasks against ~80 µs in
    a task group, and a burst of 32 holds on a fresh 3-node backend (most fan-outs
    connect) took ~32 ms of CPU here against ~39 ms with a group (medians of 6 interleaved
    runs), which under load pushed whole fan-outs past the 0.25 s node timeout
    (QuorumNotReached in 2 of those 6 bursts, none with bare tasks). A group would be
    correct: the shared deadline cancels only the
    reading task and :class:`Deadline` turns that into TimeoutError inside it. The tasks
    never outlive the request: it awaits each one, and :meth:`cancel` runs in its
    ``finally``.
    """

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: list[tuple[int, asyncio.Task[Any]]] = []

    def start(self, i: int, coro: Coroutine[Any, Any, Any]) -> None:
        self.tasks.append((i, asyncio.get_running_loop().create_task(coro)))

    async def collect(self, results: dict[int, Any]) -> None:
        for i, task in self.tasks:
            results[i] = await task

    def cancel(self) -> None:
        """Cancel the unfinished ones (only if the request was interrupted)."""
        for _, task in self.tasks:
            task.cancel()


class Node(Pipelined):
    """One Redis server: command connections, scripts, error translation.

    Commands go out on dedicated redis-py connections that this node hands out one call at
    a time (no pool lock, no per-call task): ``send`` writes a packed command, ``receive``
    reads its reply under a deadline. A connection whose call did not end with a complete
    reply (timeout, cancellation, I/O error) is closed, never reused.

    Many calls at once (thousands of holds acquired or released together, as at start-up
    or shutdown): past :data:`MAX_CALLS` calls on the wire, a call joins a queue instead of
    opening a connection of its own (a connection storm timed every call out: 2,000 holds
    taken at once on a fresh server all failed). One pump task sends the queue down one
    connection, :data:`PIPELINE` commands per write, and hands each reply to its caller:
    a queued call waits for its turn, then for one ``socket_timeout`` at most; a server
    that does not answer a batch in time fails the whole queue at once.
    """

    def __init__(
        self,
        url: NodeURL,
        *,
        socket_timeout: float,
        connect_timeout: float,
        options: dict[str, Any],
    ) -> None:
        self.url = url.url
        self.display = url.display
        self.socket_timeout = socket_timeout
        self.connect_timeout = connect_timeout
        secret = url.password or str(options.get("password") or "")
        self.errors = map_errors(self.display, secret, explain=self._explain)
        #: The connection options, for the blocking connections of other threads.
        self.options = options
        try:
            self.pool: ConnectionPool = ConnectionPool.from_url(
                url.url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                decode_responses=False,
                **options,
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"bad Redis URL {self.display!r}: {self.errors.scrub(str(exc))}"
            ) from None
        # Our calls bound themselves (connect, send and read under one deadline).
        self._kwargs = {**self.pool.connection_kwargs, "socket_timeout": None}
        if not {"driver_info", "lib_name", "lib_version"} & set(self._kwargs):
            # No CLIENT SETINFO (two commands on every new connection) unless asked for.
            self._kwargs.update(_NO_CLIENT_INFO)
        if "protocol" not in self._kwargs:
            # RESP2 unless asked for RESP3: the lean path parses the replies itself (see
            # Wire), and a private connection has no use for redis-py's maintenance
            # notifications (RESP3 push messages; also no HELLO on connect).
            self._kwargs = _resp2(self._kwargs)
        self._idle: list[Wire] = []
        self._closed = False
        Pipelined.__init__(self)
        self.deadlines = Deadlines()
        #: The server's ``run_id`` when last seen (None: not yet, or INFO is denied).
        self.run_id: str | None = None

    def _explain(self, exc: BaseException) -> str:
        """What a redis-py error means, for :attr:`errors` (which scrubs the password)."""
        text = str(exc)
        if isinstance(exc, redis.exceptions.NoPermissionError) or (
            "NOPERM" in text or "can't run this command" in text or "ACL failure" in text
        ):
            return (
                f"permission denied ({text}): the ACL user lacks a command, key or channel "
                "asynclock needs; see the ACL rules in the Redis backend docs"
            )
        if isinstance(exc, redis.exceptions.AuthenticationError):
            return "authentication failed: check the user name and password in the URL"
        if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
            return f"timed out after {self.socket_timeout:g}s (socket_timeout)"
        if "NOAUTH" in text or "WRONGPASS" in text:
            return "authentication failed: check the user name and password in the URL"
        return f"{type(exc).__name__}: {exc}" if text else type(exc).__name__

    def error(self, what: str, exc: BaseException) -> BackendUnavailable:
        """``exc`` as ``BackendUnavailable("<display>: <what> failed: …")``."""
        return self.errors.unavailable(f"{what} failed", exc)

    def reason(self, exc: BaseException) -> str:
        """A short, password-free reason for one node's failure."""
        msg = str(exc)
        prefix = f"{self.display}: "
        return msg[len(prefix) :] if msg.startswith(prefix) else self.errors.scrub(msg or repr(exc))

    # -- the command path ----------------------------------------------------------------

    async def _connect(self) -> Wire:
        conn: AbstractConnection = self.pool.connection_class(**self._kwargs)
        await conn.connect()  # type: ignore[no-untyped-call]
        return Wire(conn)

    def send(self, packed: bytes) -> Wire | None:
        """Write ``packed`` on an idle connection; None if there is none.

        Never waits, so callers can start one command on many nodes in a row. The bytes
        go to the connection's transport, which sends at once or buffers; a connection
        that died meanwhile shows up as a ConnectionError when its reply is read.
        """
        if not self._idle:
            return None
        writer = self._idle[-1].writer
        if writer is None:
            return None  # ``receive`` sends through redis-py's public path instead
        writer.write(packed)
        return self._idle.pop()

    def keep(self, wire: Wire) -> bool:
        """Put a connection whose reply was read in full back for reuse (False: full)."""
        if self._closed or len(self._idle) >= MAX_IDLE_CONNECTIONS:
            return False
        self._idle.append(wire)
        return True

    async def receive(self, wire: Wire | None, packed: bytes, deadline: float | None) -> Any:
        """The reply to ``packed`` sent on ``wire`` (None: not sent yet), by ``deadline``
        (event-loop time; None: the caller bounds the wait). A reused connection that
        turns out dead (the server restarted) is replaced once; every script is safe to
        run twice."""
        if deadline is None:
            return await self._receive(wire, packed)
        with self.deadlines.at(deadline):
            return await self._receive(wire, packed)

    async def _receive(self, wire: Wire | None, packed: bytes) -> Any:
        if wire is not None:
            try:
                return await self._read(wire)
            except redis.exceptions.ConnectionError:
                pass
        elif self._idle:  # not sent yet (see ``send``): the public path
            wire = self._idle.pop()
            try:
                await wire.conn.send_packed_command(packed, check_health=False)
                return await self._read(wire)
            except redis.exceptions.ConnectionError:
                await drop_connection(wire.conn)
        wire = await self._connect()
        try:
            await wire.conn.send_packed_command(packed, check_health=False)
        except BaseException:
            await drop_connection(wire.conn)
            raise
        return await self._read(wire)

    async def _read(self, wire: Wire) -> Any:
        try:
            reply = await wire.read()
        except redis.exceptions.ResponseError:
            await self._keep(wire)  # a complete (error) reply: the connection is fine
            raise
        except BaseException:
            await drop_connection(wire.conn)
            raise
        await self._keep(wire)
        return reply

    async def _keep(self, wire: Wire) -> None:
        if not self.keep(wire):
            await drop_connection(wire.conn)

    async def call(self, packed: bytes, deadline: float, *, queue_deadline: bool = False) -> Any:
        """Send ``packed`` and return its reply (raw driver exceptions). Past MAX_CALLS
        calls on the wire it queues for the pump, unbounded unless ``queue_deadline``
        (a Redlock fan-out: every node's answer is due at ``deadline``)."""
        if self._calls >= MAX_CALLS:
            return await self._queued(packed, deadline if queue_deadline else None)
        self._calls += 1
        try:
            return await self.receive(self.send(packed), packed, deadline)
        finally:
            self._calls -= 1

    async def call_chain(
        self, packed: bytes, deadline: float, then: Callable[[Any], bytes | None]
    ) -> list[Any]:
        """Send ``packed`` and read its reply, then, while ``then(reply)`` gives a command,
        send that on the same connection and read its reply: every reply, in order. For
        what must follow on one connection: ``WAIT`` counts the replicas that have this
        connection's writes, ``ASKING`` lets the next command in. Raw driver exceptions (an
        error reply ends the chain); a reused connection found dead at the first command
        is replaced once (``packed`` must be safe to repeat)."""
        with self.deadlines.at(deadline):
            reused = bool(self._idle)
            wire = self._idle.pop() if reused else await self._connect()
            try:
                try:
                    await wire.conn.send_packed_command(packed, check_health=False)
                    reply = await wire.read()
                except redis.exceptions.ConnectionError:
                    if not reused:
                        raise
                    await drop_connection(wire.conn)
                    wire = await self._connect()
                    await wire.conn.send_packed_command(packed, check_health=False)
                    reply = await wire.read()
                replies = [reply]
                while (follow := then(reply)) is not None:
                    await wire.conn.send_packed_command(follow, check_health=False)
                    reply = await wire.read()
                    replies.append(reply)
            except redis.exceptions.ResponseError:
                await self._keep(wire)  # a complete (error) reply: the connection is fine
                raise
            except BaseException:
                await drop_connection(wire.conn)
                raise
            await self._keep(wire)
            return replies

    def deadline(self, timeout: float | None = None) -> float:
        return asyncio.get_running_loop().time() + (
            self.socket_timeout if timeout is None else timeout
        )

    # -- scripts -------------------------------------------------------------------------

    async def load(self, timeout: float | None = None) -> None:
        """Load every script (also checks that the server is reachable and lets us in),
        and read the server's ``run_id``."""
        deadline = self.deadline(timeout)
        try:
            for script, text in SCRIPTS.items():
                if script not in LAZY:
                    await self.call(pack(b"SCRIPT", b"LOAD", text.encode()), deadline)
            self.run_id = await self.read_run_id(deadline)
        except Exception as exc:
            raise self.error("connect", exc) from exc

    async def read_run_id(self, deadline: float) -> str | None:
        """The server's ``run_id`` (new on every start), or None if ``INFO`` is denied."""
        try:
            info = await self.call(pack(b"INFO", b"server"), deadline)
        except redis.exceptions.ResponseError as exc:
            logger.debug("INFO on %s refused: %r", self.display, exc)
            return None
        return parse_run_id(info)

    async def run(
        self,
        script: str,
        keys: Sequence[bytes],
        args: Sequence[bytes],
        timeout: float | None = None,
    ) -> Any:
        """EVALSHA ``script``; load it again on NOSCRIPT (after a restart or SCRIPT FLUSH)."""
        deadline = self.deadline(timeout)
        packed = pack_script(script, keys, args)
        try:
            try:
                return await self.call(packed, deadline)
            except redis.exceptions.NoScriptError:
                await self.call(pack(b"SCRIPT", b"LOAD", SCRIPTS[script].encode()), deadline)
                return await self.call(packed, deadline)
        except Exception as exc:
            raise self.error(script, exc) from exc

    async def get(self, key: bytes) -> bytes | None:
        try:
            value = await self.call(pack(b"GET", key), self.deadline())
        except Exception as exc:
            raise self.error("get", exc) from exc
        return value if isinstance(value, bytes) or value is None else str(value).encode()

    def make_connection(self) -> AbstractConnection:
        """A dedicated connection (for pub/sub) that waits for messages without a timeout."""
        # RESP2: messages come back as plain replies (RESP3 routes them to a push handler).
        conn: AbstractConnection = self.pool.connection_class(**_resp2(self._kwargs))
        return conn

    async def aclose(self) -> None:
        self._closed = True
        self.stop_pump()
        idle, self._idle = self._idle, []
        for wire in idle:
            await drop_connection(wire.conn)
        try:
            await self.pool.disconnect()
        except Exception as exc:  # pragma: no cover - best effort
            logger.debug("closing %s: %r", self.display, exc)


def parse_run_id(info: object) -> str | None:
    """``run_id`` from an ``INFO server`` reply."""
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:") :].strip() or None
    return None


def pack_script(script: str, keys: Sequence[bytes], args: Sequence[bytes]) -> bytes:
    try:
        count = _NUMBERS[len(keys)]
    except IndexError:
        count = b"%d" % len(keys)
    return pack(b"EVALSHA", SHAS[script], count, *keys, *args)
