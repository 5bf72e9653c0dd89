"""One bidirectional etcd stream (keep-alives or watches), opened again whenever it breaks."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import grpc.aio

from ._grpc import end_stream, settle, start, wait_done

if TYPE_CHECKING:
    from .client import EtcdClient

logger = logging.getLogger("asynclock.etcd")

#: How long a broken stream waits before it reconnects (doubling, with jitter).
STREAM_BACKOFF = (0.05, 1.0)


class Stream:
    """The stream ``path`` on ``client``'s channel. :meth:`send` queues a request;
    ``on_reply(reply)`` runs for each reply; when the stream breaks, the requests not yet
    written are dropped and ``on_broken(error)`` runs (the server forgot the stream's state).
    :meth:`run` keeps it open, reconnecting with backoff; :meth:`reset` reconnects now."""

    def __init__(
        self,
        client: EtcdClient,
        path: str,
        response: Any,
        on_reply: Callable[[Any], None],
        on_broken: Callable[[BaseException], None],
    ) -> None:
        self._client = client
        self._path = path
        self._response = response
        self._on_reply = on_reply
        self._on_broken = on_broken
        self._outbox: deque[Any] = deque()
        self._wake = anyio.Event()
        self._reset = anyio.Event()

    def send(self, message: Any) -> None:
        self._outbox.append(message)
        self._wake.set()

    def reset(self) -> None:
        """Reconnect: the stream looks dead, or the client failed over."""
        self._reset.set()

    async def run(self) -> None:
        client, path, outbox = self._client, self._path, self._outbox
        backoff = STREAM_BACKOFF[0]
        while True:
            call = client.open_stream(path, self._response)
            if call is None:
                return
            got_reply = False
            cause: BaseException | None = None
            # One read is always outstanding and is never cancelled (cancelling a read
            # cancels the whole call, and its completions would outlive the event loop);
            # the stream ends by half-closing it and reading to the end.
            reading: asyncio.Future[Any] | None = None

            async def write_loop(call: Any = call) -> None:
                while True:
                    while outbox:
                        message = outbox.popleft()
                        await settle(call.write(message), cancel=False, inflight=client.inflight)
                    event = self._wake = anyio.Event()
                    if not outbox:
                        await event.wait()

            async def read_loop(call: Any = call) -> None:
                nonlocal got_reply, reading
                while True:
                    reading = start(call.read(), client.inflight)
                    await wait_done(reading)
                    reply, reading = reading.result(), None
                    if reply is grpc.aio.EOF:
                        return
                    got_reply = True
                    self._on_reply(reply)

            async def watch_reset(tg: anyio.abc.TaskGroup, reset: anyio.Event) -> None:
                await reset.wait()  # a dead-looking stream, or a fail-over: reconnect
                tg.cancel_scope.cancel()

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(write_loop)
                    reset = self._reset = anyio.Event()
                    tg.start_soon(watch_reset, tg, reset)
                    await read_loop()
                    tg.cancel_scope.cancel()
            except (Exception, BaseExceptionGroup) as exc:  # any break
                cause = _first_error(exc)  # what broke, not the task group around it
            finally:
                with anyio.CancelScope(shield=True):
                    await end_stream(call, reading)
            error = client.stream_error(path, cause)
            logger.debug("etcd %s stream restarts: %s", path, error)
            outbox.clear()
            self._on_broken(error)
            await client.close_retired(time.monotonic() - 2 * client.timeout)
            if got_reply:
                backoff = STREAM_BACKOFF[0]
            await anyio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, STREAM_BACKOFF[1])


def _first_error(exc: BaseException) -> BaseException:
    """The first error inside (nested) exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
