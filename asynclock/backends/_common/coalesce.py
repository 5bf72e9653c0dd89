"""Calls that arrive while one is in flight go out together: many blocks exiting at once
(as at shutdown) release in a few server calls instead of one each (issue 45 item 3).

A call with nothing else in flight goes out at once, alone, in its caller's task: the
usual release costs what it did. Calls made while one is in flight queue; one pump task
(made when the first one queues, gone once the queue is empty) sends them in batches of
at most ``limit``, one call per key per batch, one batch at a time, and answers each
caller with its own answer. A batch is never sent by a caller's task, so a caller that is
cancelled (or times out) cuts short nobody else's release: its entry is skipped if not yet
sent, and its answer dropped if it was.

asyncio-only, like the drivers that use it (grpc.aio, asyncpg).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from ..._core.exceptions import BackendUnavailable

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class _Entry(Generic[Item, Answer]):
    __slots__ = ("future", "item", "key")

    def __init__(self, key: Hashable, item: Item, future: asyncio.Future[Answer]) -> None:
        self.key, self.item, self.future = key, item, future


class Coalesced(Generic[Item, Answer]):
    """``await coalesced(key, item)``: ``one(item)`` when nothing is in flight, else
    ``item`` in the next batch of ``many(items)``.

    ``many`` returns one answer per item, in order: a value, or an exception instance for
    that caller alone. If ``many`` raises, every caller of the batch gets a
    :class:`BackendUnavailable` of its own saying so.
    """

    def __init__(
        self,
        one: Callable[[Item], Awaitable[Answer]],
        many: Callable[[list[Item]], Awaitable[Sequence[Answer | BaseException]]],
        *,
        limit: int,
        what: str,
    ) -> None:
        self._one = one
        self._many = many
        self._limit = limit
        #: For errors: "<display>: <what> failed".
        self._what = what
        #: Calls sent and not yet answered (alone or as a batch).
        self._inflight = 0
        self._queue: deque[_Entry[Item, Answer]] = deque()
        self._pump: asyncio.Task[None] | None = None
        self._closed: BaseException | None = None
        #: Batches sent (for tests and benchmarks).
        self.batches = 0

    async def __call__(self, key: Hashable, item: Item) -> Answer:
        if self._closed is not None:
            raise BackendUnavailable(f"{self._what} failed: {self._closed}")
        if not self._inflight and not self._queue:
            self._inflight += 1
            try:
                return await self._one(item)
            finally:
                self._inflight -= 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        self._queue.append(_Entry(key, item, future))
        if self._pump is None:
            self._pump = loop.create_task(self._run())
        return await future  # a cancelled caller cancels it: the pump skips it

    def close(self, why: str) -> None:
        """The driver closes: the pump stops and every queued call fails."""
        self._closed = BackendUnavailable(why)
        if self._pump is not None:
            self._pump.cancel()
        self._fail_queue(why)

    async def _run(self) -> None:
        try:
            while self._queue:
                batch = self._next_batch()
                if batch:
                    await self._send(batch)
        except BaseException as exc:
            self._fail_queue(repr(exc))
            raise
        finally:
            self._pump = None

    def _next_batch(self) -> list[_Entry[Item, Answer]]:
        """The oldest queued entries still awaited, one per key, at most ``limit``; an
        entry whose key is in the batch already waits, in its place, for the next one (two
        calls on one key in one server call could not be told apart)."""
        queue = self._queue
        batch: list[_Entry[Item, Answer]] = []
        later: list[_Entry[Item, Answer]] = []
        keys: set[Hashable] = set()
        while queue and len(batch) < self._limit:
            entry = queue.popleft()
            if entry.future.done():
                continue  # its caller was cancelled before it was sent: never sent
            if entry.key in keys:
                later.append(entry)
                continue
            keys.add(entry.key)
            batch.append(entry)
        queue.extendleft(reversed(later))
        return batch

    async def _send(self, batch: list[_Entry[Item, Answer]]) -> None:
        self._inflight += 1
        self.batches += 1
        try:
            answers = await self._many([entry.item for entry in batch])
        except BaseException as exc:  # (the pump cancelled: the driver closes)
            why = repr(exc) if self._closed is None else str(self._closed)
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(BackendUnavailable(f"{self._what} failed: {why}"))
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self._inflight -= 1
        for entry, answer in zip(batch, answers, strict=True):
            if entry.future.done():
                continue  # its caller gave up waiting (cancelled, timed out)
            if isinstance(answer, BaseException):
                entry.future.set_exception(answer)
            else:
                entry.future.set_result(answer)

    def _fail_queue(self, why: str) -> None:
        while self._queue:
            future = self._queue.popleft().future
            if not future.done():
                future.set_exception(BackendUnavailable(f"{self._what} failed: {why}"))
