"""The clock seam: everything that measures time for leases goes through a Clock."""

from __future__ import annotations

import time
from typing import Protocol

import anyio


class Clock(Protocol):
    """A monotonic clock in seconds plus a way to sleep until one of its instants."""

    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class MonotonicClock:
    """The default clock: ``time.monotonic`` (CLOCK_MONOTONIC on Linux, system-wide)."""

    #: ``time.monotonic`` itself, not a wrapper: it is read several times per acquisition.
    now = staticmethod(time.monotonic)

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        await anyio.sleep(max(0.0, delay))
