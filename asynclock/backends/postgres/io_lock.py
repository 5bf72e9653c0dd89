"""The pinned connection's lock, with a fast lane for renewals.

A backend's statements share one connection, one at a time. With a first-come lock a
renewal waited behind every acquire and release already queued: 50,000 blocks exiting at
once (or 500 acquisitions in flight) put thousands of statements ahead of it, and leases
still held passed their local deadline waiting in line (issue 45: 2,292 of 50,000 lost in
``mode=lease``). Renewals keep every held lease alive, so they go first; the others keep
their order. asyncio-only (asyncpg is): uncontended it takes no trip through the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType


class IOLock:
    """``async with lock:`` in order; ``async with lock.first:`` ahead of them."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._queued: deque[asyncio.Future[None]] = deque()
        self.first = _First(self)

    def locked(self) -> bool:
        return self._held

    def take(self) -> bool:
        """Take the lock if nobody holds it or waits for it (no await: the hot path's
        usual case); False: ``await acquire()``."""
        if not self._held and not self._urgent and not self._queued:
            self._held = True
            return True
        return False

    async def acquire(self, urgent: bool = False) -> None:
        if self.take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._urgent if urgent else self._queued
        line.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed to us as we were cancelled: hand it on
            else:
                # Still in line, unless a release passed over it (cancelled first) and
                # took it out already.
                with contextlib.suppress(ValueError):
                    line.remove(waiter)
            raise

    def release(self) -> None:
        for line in (self._urgent, self._queued):
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the lock passes to it, still held
                    return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class _First:
    def __init__(self, lock: IOLock) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        await self._lock.acquire(urgent=True)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()
