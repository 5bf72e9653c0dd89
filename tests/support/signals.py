"""Events tests can wait on instead of polling a backend's state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

import asynclock
from asynclock.backends import Busy
from asynclock.testing import DriverFaults


class BusyWatch:
    """Counts a backend's acquire attempts that found the name held, and lets a test wait
    until the n-th one has happened (the waiter is then queued/subscribed)."""

    def __init__(self, backend: asynclock.Backend) -> None:
        self.count = 0
        self._waiting: list[tuple[int, anyio.Event]] = []

        async def acquire(real: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
            result = await real(*args, **kwargs)
            if isinstance(result, Busy):
                self.count += 1
                for n, event in self._waiting:
                    if self.count >= n:
                        event.set()
            return result

        DriverFaults(backend).around("acquire", acquire)

    async def reached(self, n: int) -> None:
        """Return once ``n`` attempts in all have found the name held."""
        if self.count >= n:
            return
        event = anyio.Event()
        self._waiting.append((n, event))
        await event.wait()
