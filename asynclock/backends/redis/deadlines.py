"""The deadline timer of a Redis driver's replies: one timer for the calls in progress,
moved only when an earlier deadline starts (not a timer per call)."""

from __future__ import annotations

import asyncio
import math


class Deadlines:
    """Deadlines for many short calls, kept by one timer.

    ``with deadlines.at(when):`` behaves like ``asyncio.timeout_at(when)``: at ``when`` the
    task is cancelled, and the block raises ``TimeoutError`` (a cancellation from anyone
    else propagates unchanged, counted as asyncio counts it). ``asyncio.timeout_at``
    schedules and cancels a timer per call, which at thousands of calls a second costs
    more than the rest of a call's Python; here one timer waits for the earliest deadline
    of the calls in progress and is moved only when a call with an earlier deadline
    starts (the calls of one driver mostly share one timeout, so rarely).
    """

    __slots__ = ("_armed", "_calls", "_handle", "_loop")

    def __init__(self) -> None:
        self._calls: set[Deadline] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = math.inf  # when the timer fires (inf: no timer)

    def at(self, when: float) -> Deadline:
        return Deadline(self, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._loop = loop
        self._armed = when
        self._handle = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed = math.inf
        loop = self._loop
        assert loop is not None
        now = loop.time()
        later = math.inf
        for call in self._calls:
            if call.when <= now:
                if not call.fired:
                    call.fired = True
                    call.task.cancel()
            elif call.when < later:
                later = call.when
        if later < math.inf:
            self._arm(loop, later)


class Deadline:
    """One call's deadline (see :class:`Deadlines`); a sync context manager."""

    __slots__ = ("cancelling", "fired", "owner", "task", "when")

    def __init__(self, owner: Deadlines, when: float) -> None:
        self.owner = owner
        self.when = when
        self.fired = False

    def __enter__(self) -> Deadline:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()
        owner = self.owner
        if owner._loop is not loop:  # a new event loop: the old timer is gone with it
            owner._calls.clear()
            owner._handle = None
            owner._armed = math.inf
        owner._calls.add(self)
        if self.when < owner._armed:
            owner._arm(loop, self.when)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: object,
    ) -> None:
        self.owner._calls.discard(self)
        if (
            self.fired
            and self.task.uncancel() <= self.cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        ):
            raise TimeoutError from exc
