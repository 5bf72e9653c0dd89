"""Bounded, shielded driver calls (G6): a release must neither be cut short by the
caller's cancellation nor hang past ``release_timeout``.

Every bounded call has the same timeout, so deadlines come due in the order the calls
began: one task per backend sleeps until the oldest one instead of an event-loop timer
being armed and cancelled per call (a measurable share of a fast hold). A call that
completes without suspending is never queued at all.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

import anyio

from .clock import Clock

T = TypeVar("T")
logger = logging.getLogger("asynclock")


class CallBounds:
    """Cancels the scope of a bounded call still running ``timeout`` seconds after its
    first suspension. ``run()`` must run in a task for as long as calls are bounded."""

    def __init__(self, clock: Clock, timeout: float) -> None:
        self.clock = clock
        self.timeout = timeout
        #: The bounded calls in flight, oldest first: scope -> deadline. A call is added
        #: with :meth:`arm`; whoever armed it deletes it when it ends, with
        #: ``inflight.pop(scope, None)`` (None: the deadline fired and took it out). A
        #: dict keeps insertion order, and with one timeout that is deadline order.
        self.inflight: dict[anyio.CancelScope, float] = {}
        #: Set while :meth:`run` waits for a call to be armed (none is in flight).
        self.parked: anyio.Event | None = None

    def arm(self, scope: anyio.CancelScope) -> None:
        """Start counting down for ``scope`` (see :attr:`inflight`). The lock's release
        does the same inline (``Acquisition.release``)."""
        self.inflight[scope] = self.clock.now() + self.timeout
        if self.parked is not None:
            self.unpark()

    def unpark(self) -> None:
        """Wake :meth:`run`: a call was armed."""
        if self.parked is not None:
            self.parked.set()
            self.parked = None

    async def run(self) -> None:
        inflight = self.inflight
        while True:
            if not inflight:
                self.parked = anyio.Event()
                await self.parked.wait()
                continue
            scope, deadline = next(iter(inflight.items()))
            if self.clock.now() < deadline:
                # Calls armed meanwhile have later deadlines: no need to wake earlier.
                await self.clock.sleep_until(deadline)
                continue
            del inflight[scope]
            scope.cancel()


class ArmOnSuspend(Generic[T]):
    """Await ``coro`` (like ``yield from``) inside ``scope``, which the caller has entered;
    the first time it suspends, ``bounds`` starts counting down for ``scope``.

    ``first``: what ``coro.send(None)`` already yielded, when the caller started it.
    """

    __slots__ = ("_bounds", "_coro", "_first", "_scope")

    NOT_STARTED: Any = object()

    def __init__(
        self,
        coro: Coroutine[Any, Any, T],
        scope: anyio.CancelScope,
        bounds: CallBounds,
        first: Any = NOT_STARTED,
    ):
        self._coro, self._scope, self._bounds, self._first = coro, scope, bounds, first

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        value = self._first
        if value is ArmOnSuspend.NOT_STARTED:
            try:
                value = coro.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        scope = self._scope
        self._bounds.arm(scope)
        try:
            while True:
                try:
                    sent = yield value
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:
                    try:
                        value = coro.throw(exc)
                    except StopIteration as done:
                        return done.value  # type: ignore[no-any-return]
                else:
                    try:
                        value = coro.send(sent)
                    except StopIteration as done:
                        return done.value  # type: ignore[no-any-return]
        finally:
            self._bounds.inflight.pop(scope, None)


async def shielded_call(coro: Coroutine[Any, Any, T], bounds: CallBounds) -> T | None:
    """Run ``coro`` shielded from cancellation, for at most ``bounds.timeout`` seconds
    after it first suspends. Returns None if it timed out.

    The coroutine runs entirely inside the shielded scope (so a driver may open cancel
    scopes of its own).
    """
    with anyio.CancelScope(shield=True) as scope:
        return await ArmOnSuspend(coro, scope, bounds)
    return None


async def cleanup(call: Coroutine[Any, Any, object], bounds: CallBounds, what: str) -> None:
    """A clean-up call, shielded and bounded like a release; failures are logged."""

    async def run() -> bool:
        await call
        return True

    try:
        done = await shielded_call(run(), bounds)
    except Exception as exc:
        logger.debug("%s failed: %r", what, exc)
        return
    if done is None:
        logger.warning("%s timed out after %gs", what, bounds.timeout)
