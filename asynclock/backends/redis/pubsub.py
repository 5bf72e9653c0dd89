"""The pub/sub listener: one connection per node carrying every channel its driver watches
(release wake-ups, the waiter probe), and the node's ``run_id`` on every (re)connect."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import anyio
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection

from .wire import Node, drop_connection, parse_run_id

logger = logging.getLogger("asynclock.redis")


class Listener:
    """One pub/sub connection to a node, carrying every channel its driver watches.

    ``on_message(channel, payload)`` runs for each message; ``on_reset()`` after the
    connection drops (messages may have been missed); ``on_resumed()`` once a connection
    made after a drop has its subscriptions confirmed again (the time to wake waiters:
    waking them at the drop sends their retry to a server that is likely down, a restart
    turned into a failure); ``on_connect(run_id, reconnected)`` after each connect, with
    the server's ``run_id`` (None if ``INFO`` is denied).
    :meth:`run` is the reader; the driver runs it from :meth:`Driver.background`. It
    connects on the first subscription or :meth:`keep_connected`, and reconnects with
    backoff: while a lease is held, this connection is how a server restart is noticed
    (the socket closes at once), not the next renewal.
    """

    #: Longest pause between reconnect attempts.
    MAX_BACKOFF = 0.25

    def __init__(
        self,
        node: Node,
        on_message: Callable[[str, bytes], None],
        on_reset: Callable[[], None],
        on_resumed: Callable[[], None],
        on_connect: Callable[[str | None, bool], None] | None = None,
    ) -> None:
        self.node = node
        self.on_message = on_message
        self.on_reset = on_reset
        self.on_resumed = on_resumed
        self.on_connect = on_connect
        self.wanted: set[str] = set()
        self.confirmed: set[str] = set()
        #: Bumped on every (re)connect: a subscription confirmed in an older epoch is void.
        self.epoch = 0
        self._conn: AbstractConnection | None = None
        self._confirm_events: dict[str, anyio.Event] = {}
        self._write = anyio.Lock()
        self._needed = anyio.Event()

    def keep_connected(self) -> None:
        """Connect now (if not yet) and stay connected: a lease is held on this node."""
        self._needed.set()

    async def subscribe(self, channel: str, wait: float) -> None:
        """Subscribe; wait up to ``wait`` seconds for the server to confirm. Never raises."""
        self.wanted.add(channel)
        if channel in self.confirmed:
            return
        self._needed.set()
        event = self._confirm_events.setdefault(channel, anyio.Event())
        await self._send("SUBSCRIBE", channel)
        with anyio.move_on_after(wait):
            await event.wait()

    async def unsubscribe(self, channel: str) -> None:
        self.wanted.discard(channel)
        self.confirmed.discard(channel)
        await self._send("UNSUBSCRIBE", channel)

    async def _send(self, *args: str) -> None:
        conn = self._conn
        if conn is None:
            return  # the reader subscribes to everything wanted when it connects
        try:
            async with self._write:
                await conn.send_command(*args, check_health=False)
        except Exception as exc:
            logger.debug("pub/sub %s on %s failed: %r", args[0], self.node.display, exc)

    async def run(self) -> None:
        """Read messages until cancelled (the backend closing)."""
        await self._needed.wait()
        backoff = 0.02
        connected = dropped = False  # dropped: on_resumed is due at the next connection
        while True:
            conn = self.node.make_connection()
            try:
                await conn.connect()  # type: ignore[no-untyped-call]
                run_id = await self._run_id(conn) if self.on_connect is not None else None
                self._conn = conn
                resubscribing = set(self.wanted)
                if resubscribing:
                    async with self._write:
                        await conn.send_command("SUBSCRIBE", *resubscribing, check_health=False)
                backoff = 0.02
                if self.on_connect is not None:
                    self.on_connect(run_id, connected)
                connected = True
                while True:
                    if dropped and not (resubscribing & self.wanted) - self.confirmed:
                        dropped = False
                        self.on_resumed()
                    reply = await conn.read_response(timeout=math.inf)
                    self._handle(reply)
            except Exception as exc:
                logger.debug("pub/sub connection to %s dropped: %r", self.node.display, exc)
            finally:
                self._conn = None
                self.confirmed.clear()
                self.epoch += 1
                await drop_connection(conn)
            dropped = True
            self.on_reset()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, self.MAX_BACKOFF)

    async def _run_id(self, conn: AbstractConnection) -> str | None:
        """The server's ``run_id``, read before subscribing (None if INFO is denied)."""
        await conn.send_command("INFO", "server", check_health=False)
        try:
            reply = await conn.read_response(timeout=self.node.connect_timeout)
        except redis.exceptions.ResponseError:
            return None
        return parse_run_id(reply)

    def _handle(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind = reply[0]
        channel = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        if kind == b"message":
            self.on_message(channel, reply[2] if isinstance(reply[2], bytes) else b"")
        elif kind == b"subscribe":
            if channel in self.wanted:
                self.confirmed.add(channel)
            event = self._confirm_events.pop(channel, None)
            if event is not None:
                event.set()
