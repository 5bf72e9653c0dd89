"""Helpers for your own tests: an in-process backend, a lease loss on demand, a clock that
moves only when told, the renewer's next round, and faults injected into a driver's calls.

* :func:`memory_backend` — a fresh ``memory://`` backend.
* :func:`force_loss` — make a lease lost right now (the holder is cancelled, ``LeaseLost``).
* :class:`ManualClock` — a :class:`~asynclock.Clock` for ``Backend(driver, clock=...)`` or
  ``connect(url, clock=...)``: deadlines and renewals move when you call ``advance``.
* :func:`next_renewal_round` — wait until the backend's renewer has finished its next
  round (every held lease renewed, refused or failed once): no sleeping for a heartbeat.
* :class:`DriverFaults` — make a backend's driver calls fail, hang, or run through your
  own hook (count them, cancel at a point, delay them), then put the driver back.

The ``asynclock`` pytest plugin (its ``lock_backend`` fixture and ``--asynclock-url``
option) is :mod:`asynclock.pytest_plugin`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._core.backend import Backend
from ._core.connect import connect
from ._core.driver import Driver
from ._core.lease import Lease

if TYPE_CHECKING:
    pass

__all__ = (
    "DriverFaults",
    "ManualClock",
    "force_loss",
    "memory_backend",
    "next_renewal_round",
)


def memory_backend(**options: Any) -> Backend:
    """A fresh ``memory://`` backend: ``async with memory_backend() as backend: ...``."""
    return connect("memory://", **options)


def force_loss(held: object, reason: str = "forced by asynclock.testing") -> None:
    """Make what you hold lost right now, as if its renewal had been refused: a
    :class:`~asynclock.Lease`, or anything that holds one as ``.lease`` (a claim, a
    leadership term, a semaphore permit, a partition).

    The holder's ``async with`` body is cancelled and the block raises ``LeaseLost`` with
    ``reason``. The server-side lease is left to be released on exit (owner-checked).
    """
    lease = held if isinstance(held, Lease) else getattr(held, "lease", None)
    if not isinstance(lease, Lease):
        raise TypeError(
            "force_loss() takes a Lease, or something that holds one as .lease (a claim, a "
            f"term, a permit), not {type(held).__name__}"
        )
    lease._grantor.lose(lease, reason)


async def next_renewal_round(backend: Backend) -> None:
    """Return once ``backend``'s renewer has finished its next round trip.

    A round renews every lease the backend holds in one call per server (or finds it
    refused, or fails and is retried later); after it, ``lease.deadline``, ``lease.lost``
    and ``backend.stats()`` show its outcome. The renewer runs a round every
    ``ttl * heartbeat`` seconds of the backend's clock (with a :class:`ManualClock`, once
    ``advance`` has moved past that point).
    """
    await backend._next_renewal_round()


class ManualClock:
    """A clock that moves only when told to; sleepers wake once it passes their deadline.

    ``Backend(driver, clock=ManualClock())`` (or ``connect(url, clock=...)``) makes lease
    deadlines, renewal times and ``lease.remaining()`` follow :meth:`advance` instead of the
    wall clock, so a test can step past a heartbeat or a deadline without sleeping::

        clock = ManualClock(1000.0)
        async with asynclock.Backend(MemoryDriver(), clock=clock) as backend:
            lease = await backend.acquire("x", ttl=9.0)
            clock.advance(3.0)                      # one heartbeat (ttl / 3)
            await next_renewal_round(backend)       # renewed from the new "now"

    Note that the server keeps its own time: a server-side expiry (Redis ``PX``, a
    PostgreSQL lease row) does not move with this clock.
    """

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"ManualClock(start={start!r}): start must be a finite number")
        self._now = float(start)
        self._moved: anyio.Event | None = None

    def now(self) -> float:
        return self._now

    async def sleep_until(self, deadline: float) -> None:
        while self._now < deadline:
            if self._moved is None:
                self._moved = anyio.Event()
            await self._moved.wait()

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (≥ 0) and wake every sleeper it passed."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(
                f"ManualClock.advance(seconds={seconds!r}): seconds must be a finite number "
                ">= 0 (a monotonic clock never goes back)"
            )
        self._now += seconds
        if self._moved is not None:
            self._moved.set()
            self._moved = None


#: ``handler(call, *args, **kwargs)``: ``call`` is the driver's method as it was before.
Handler = Callable[..., Awaitable[Any]]

#: The driver methods faults can be injected into: the ``async`` primitives of ``Driver``.
FAULTABLE = tuple(
    sorted(
        name
        for name, member in vars(Driver).items()
        if not name.startswith("_") and inspect.iscoroutinefunction(member)
    )
)

_MISSING = object()


class DriverFaults:
    """Inject faults into a backend's driver calls, in place; :meth:`restore` undoes them.

    The core calls its driver (``acquire``, ``extend``, ``release``, ``watch``, …) through
    ``backend.driver``; this replaces those methods on that one driver object::

        with DriverFaults(backend) as faults:
            faults.fail("extend", ConnectionError("partition"))  # every renewal fails
            hung = faults.hang("release", calls=1)               # the first release hangs
            faults.around("acquire", counting)                   # your own hook

    A hook is ``async def hook(call, *args, **kwargs)``: ``call`` is the method as it was
    before (the real driver's, or an earlier hook's), so a hook can count calls, do
    something before or after the server call, or not make it at all. Faults on one method
    stack: the latest is outermost. Used as a context manager, the driver is restored on
    exit.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.driver = backend.driver
        self._saved: dict[str, Any] = {}

    def _check(self, method: str) -> None:
        if method not in FAULTABLE:
            raise ValueError(
                f"DriverFaults: method={method!r} is not a driver call; choose from "
                f"{', '.join(FAULTABLE)}"
            )

    def around(self, method: str, handler: Handler) -> None:
        """Route every call of ``driver.<method>`` through ``handler(call, *args, **kwargs)``."""
        self._check(method)
        if method not in self._saved:
            self._saved[method] = vars(self.driver).get(method, _MISSING)
        call = getattr(self.driver, method)

        async def hooked(*args: Any, **kwargs: Any) -> Any:
            return await handler(call, *args, **kwargs)

        setattr(self.driver, method, hooked)

    def fail(self, method: str, error: BaseException, *, calls: int | None = None) -> None:
        """Make ``driver.<method>`` raise ``error`` instead of calling the server.

        ``calls``: only that many calls fail, the later ones go through (default: all).
        """
        left = self._count(method, calls)

        async def failing(call: Handler, *args: Any, **kwargs: Any) -> Any:
            if left():
                raise error
            return await call(*args, **kwargs)

        self.around(method, failing)

    def hang(self, method: str, *, calls: int | None = None) -> anyio.Event:
        """Make ``driver.<method>`` never answer (until cancelled): a server that hangs.

        ``calls``: only that many calls hang, the later ones go through (default: all).
        Returns an event that is set when a call starts hanging.
        """
        left = self._count(method, calls)
        hanging = anyio.Event()

        async def hung(call: Handler, *args: Any, **kwargs: Any) -> Any:
            if left():
                hanging.set()
                await anyio.sleep_forever()
            return await call(*args, **kwargs)

        self.around(method, hung)
        return hanging

    def _count(self, method: str, calls: int | None) -> Callable[[], bool]:
        self._check(method)
        if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int)):
            raise TypeError(f"DriverFaults: calls must be an int or None, got {calls!r}")
        if calls is not None and calls < 1:
            raise ValueError(f"DriverFaults: calls must be >= 1 (or None for all), got {calls}")
        seen = 0

        def left() -> bool:
            nonlocal seen
            seen += 1
            return calls is None or seen <= calls

        return left

    def restore(self) -> None:
        """Put every method this object replaced back as it was."""
        for method, saved in self._saved.items():
            if saved is _MISSING:
                vars(self.driver).pop(method, None)
            else:
                setattr(self.driver, method, saved)
        self._saved.clear()

    def __enter__(self) -> DriverFaults:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()
