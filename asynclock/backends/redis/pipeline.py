"""Many calls to one Redis server at once: a queue past :data:`MAX_CALLS` calls on the
wire, sent by one pump task down one connection, pipelined (see ``wire.Node``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import TYPE_CHECKING, Any

import redis.exceptions
from redis.asyncio.connection import AbstractConnection

if TYPE_CHECKING:
    from .deadlines import Deadlines
    from .wire import Wire

#: Calls a node has on the wire at once, each on a connection of its own; more wait in a
#: queue that one pump task sends down one connection, pipelined (see ``Node.call``).
MAX_CALLS = 32
#: The most queued commands the pump writes at once before it reads their replies.
PIPELINE = 256


class Pipelined:
    """The queue and pump half of ``wire.Node`` (it provides the connections)."""

    display: str
    deadlines: Deadlines
    _idle: list[Wire]
    _closed: bool

    def __init__(self) -> None:
        #: Calls on the wire now (``Node.call``); past MAX_CALLS, calls queue for the pump.
        self._calls = 0
        self._queue: collections.deque[tuple[bytes, asyncio.Future[Any]]] = collections.deque()
        self._pump: asyncio.Task[None] | None = None

    async def _connect(self) -> Wire:
        raise NotImplementedError

    async def _keep(self, wire: Wire) -> None:
        raise NotImplementedError

    def deadline(self, timeout: float | None = None) -> float:
        raise NotImplementedError

    def stop_pump(self) -> None:
        """The node closes: the pump stops and every queued call fails."""
        if self._pump is not None:
            self._pump.cancel()
        self._fail_queue(redis.exceptions.ConnectionError(f"{self.display} was closed"))

    async def _queued(self, packed: bytes, deadline: float | None = None) -> Any:
        """``packed``'s reply, sent by the pump (see the class). Bounded by ``deadline``
        if given; else only by the pump, which answers every queued call, each batch
        within ``socket_timeout`` of its send."""
        if self._closed:
            raise redis.exceptions.ConnectionError(f"{self.display} is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((packed, future))
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        if deadline is None:
            return await future  # a cancelled caller cancels it: the pump skips it
        with self.deadlines.at(deadline):
            return await future

    async def _run_pump(self) -> None:
        try:
            while self._queue:
                batch: list[tuple[bytes, asyncio.Future[Any]]] = []
                while self._queue and len(batch) < PIPELINE:
                    item = self._queue.popleft()
                    if not item[1].done():
                        batch.append(item)
                if batch:
                    await self._pipeline(batch)
        except BaseException as exc:
            self._fail_queue(exc)
            raise
        finally:
            self._pump = None

    async def _pipeline(self, batch: list[tuple[bytes, asyncio.Future[Any]]]) -> None:
        """Write ``batch`` at once on one connection and answer each from its reply."""
        self._calls += 1
        try:
            wire = self._idle.pop() if self._idle else await self._connect()
            data = b"".join(packed for packed, _ in batch)
            answered = 0
            try:
                if wire.writer is not None:
                    wire.writer.write(data)
                else:
                    with self.deadlines.at(self.deadline()):
                        await wire.conn.send_packed_command(data, check_health=False)
                for _, future in batch:
                    # Each reply within socket_timeout of the one before: a timeout means
                    # the server stopped answering, not that the batch was long.
                    with self.deadlines.at(self.deadline()):
                        error: redis.exceptions.ResponseError | None = None
                        try:
                            reply = await wire.read()
                        except redis.exceptions.ResponseError as exc:
                            reply, error = None, exc
                    answered += 1
                    if not future.done():
                        if error is not None:
                            future.set_exception(error)
                        else:
                            future.set_result(reply)
            except BaseException as exc:
                await drop_connection(wire.conn)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(_batch_error(exc))
                if not isinstance(exc, Exception):
                    raise
                if not answered and isinstance(exc, TimeoutError | redis.exceptions.TimeoutError):
                    # Not one reply in socket_timeout: the server is not answering, and the
                    # rest of the queue would wait as long (if it answered some, it lives).
                    self._fail_queue(exc)
                return
            await self._keep(wire)
        except Exception as exc:  # no connection: every call of the batch fails with it
            for _, future in batch:
                if not future.done():
                    future.set_exception(_batch_error(exc))
        finally:
            self._calls -= 1

    def _fail_queue(self, exc: BaseException) -> None:
        while self._queue:
            _, future = self._queue.popleft()
            if not future.done():
                future.set_exception(_batch_error(exc))


def _batch_error(exc: BaseException) -> Exception:
    """A fresh exception for one call of a failed batch (each caller raises its own)."""
    if isinstance(exc, TimeoutError | redis.exceptions.TimeoutError):
        return redis.exceptions.TimeoutError("no reply in time")
    if isinstance(exc, redis.exceptions.ConnectionError | OSError):
        return redis.exceptions.ConnectionError(f"the connection failed: {exc!r}")
    return redis.exceptions.ConnectionError(f"the pipelined batch failed: {exc!r}")


async def drop_connection(conn: AbstractConnection) -> None:
    """Close a connection whose state is unknown (does not wait: safe while cancelled)."""
    with contextlib.suppress(Exception):
        await conn.disconnect(nowait=True)
