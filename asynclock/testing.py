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
* The ``asynclock`` pytest plugin (registered through the ``pytest11`` entry point, so it
  loads by itself): a ``lock_backend`` fixture, an open backend in the test's own event loop
  (``memory://`` unless ``--asynclock-url URL`` points it at a real server) for async tests
  run by pytest-asyncio (strict or auto mode) or anyio's plugin; and ``locked_task_runner``,
  which runs an ``asynclock_celery`` task eagerly with a real lease on that server.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._core.backend import Backend
from ._core.connect import connect
from ._core.driver import Driver
from ._core.lease import Lease

if TYPE_CHECKING:
    import pytest

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


def force_loss(lease: Lease, reason: str = "forced by asynclock.testing") -> None:
    """Make ``lease`` lost right now, as if its renewal had been refused.

    The holder's ``async with`` body is cancelled and the block raises ``LeaseLost`` with
    ``reason``. The server-side lease is left to be released on exit (owner-checked).
    """
    lease._backend._lose(lease, reason)


async def next_renewal_round(backend: Backend) -> None:
    """Return once ``backend``'s renewer has finished its next round trip.

    A round renews every lease the backend holds in one call per server (or finds it
    refused, or fails and is retried later); after it, ``lease.deadline``, ``lease.lost``
    and ``backend.stats()`` show its outcome. The renewer runs a round every
    ``ttl * heartbeat`` seconds of the backend's clock (with a :class:`ManualClock`, once
    ``advance`` has moved past that point).
    """
    await backend._renewal_round()


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


#: The command-line option naming the server ``lock_backend`` connects to.
URL_OPTION = "--asynclock-url"


# -- the pytest plugin ---------------------------------------------------------------------

try:
    import pytest as _pytest
except ImportError:  # pragma: no cover - the module is usable without pytest
    _pytest = None  # type: ignore[assignment]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asynclock")
    group.addoption(
        URL_OPTION,
        dest="asynclock_url",
        default="memory://",
        metavar="URL",
        help="lock server for the lock_backend fixture (default: memory://)",
    )


def _url(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("asynclock_url", default="memory://") or "memory://")


async def _open_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with connect(_url(request)) as backend:
        yield backend


if _pytest is not None:

    @_pytest.fixture
    async def _asynclock_backend_anyio(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
        async for backend in _open_backend(request):
            yield backend

    try:
        import pytest_asyncio as _pytest_asyncio
    except ImportError:
        _pytest_asyncio = None  # type: ignore[assignment]

    if _pytest_asyncio is not None:

        @_pytest_asyncio.fixture
        async def _asynclock_backend_asyncio(
            request: pytest.FixtureRequest,
        ) -> AsyncIterator[Backend]:
            # pytest-asyncio sets a fixture up and tears it down in two different tasks,
            # but a backend's task group must be left in the task that entered it: one
            # task of the test's loop holds the backend open from setup to teardown.
            import asyncio

            opened: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
            stop = asyncio.Event()

            async def hold() -> None:
                async with connect(_url(request)) as backend:
                    opened.set_result(backend)
                    await stop.wait()

            holder = asyncio.ensure_future(hold())
            waits: list[asyncio.Future[Any]] = [holder, opened]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not opened.done():
                await holder  # it failed to open: raise its error
            try:
                yield opened.result()
            finally:
                stop.set()
                await holder

    @_pytest.fixture
    def lock_backend(request: pytest.FixtureRequest) -> Backend:
        """An open asynclock backend, in the running test's event loop."""
        if "anyio_backend" in request.fixturenames:
            backend: Backend = request.getfixturevalue("_asynclock_backend_anyio")
            return backend
        if request.node.get_closest_marker("asyncio") is not None:
            if _pytest_asyncio is None:  # pragma: no cover
                raise RuntimeError(
                    "lock_backend: the asyncio marker is set, but pytest-asyncio is missing"
                )
            backend = request.getfixturevalue("_asynclock_backend_asyncio")
            return backend
        raise RuntimeError(
            "lock_backend is for async tests run by anyio (@pytest.mark.anyio) or "
            "pytest-asyncio (@pytest.mark.asyncio, or asyncio_mode = auto)"
        )

    @_pytest.fixture
    def locked_task_runner(request: pytest.FixtureRequest) -> Callable[..., Any]:
        """``runner(task, args=(), kwargs=None, **apply_options)`` runs an asynclock_celery
        task eagerly with a real lease on the ``--asynclock-url`` server."""
        from asynclock_celery.testing import run_eagerly

        url = _url(request)

        def run(task: Any, args: Any = (), kwargs: Any = None, **options: Any) -> Any:
            return run_eagerly(task, args, kwargs, url=url, **options)

        return run
