"""Helpers for your own tests: an in-process backend, a way to make a lease be lost, and a
pytest plugin (registered through the ``pytest11`` entry point, so it loads by itself).

The plugin adds:

* ``lock_backend``: an open backend for the test (``memory://`` unless ``--asynclock-url
  URL`` points it at a real server), in the test's own event loop. It works in async tests
  run by pytest-asyncio (strict or auto mode) and by anyio's plugin.
* ``locked_task_runner``: runs an ``asynclock_celery`` task eagerly, in the test's process,
  holding a real lease on the ``--asynclock-url`` server (``memory://`` by default).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ._core.backend import Backend
from ._core.connect import connect
from ._core.lease import Lease

if TYPE_CHECKING:
    import pytest

__all__ = ("force_loss", "memory_backend")

#: The command-line option naming the server ``lock_backend`` connects to.
URL_OPTION = "--asynclock-url"


def memory_backend(**options: Any) -> Backend:
    """A fresh ``memory://`` backend: ``async with memory_backend() as backend: ...``."""
    return connect("memory://", **options)


def force_loss(lease: Lease, reason: str = "forced by asynclock.testing") -> None:
    """Make ``lease`` lost right now, as if its renewal had been refused.

    The holder's ``async with`` body is cancelled and the block raises ``LeaseLost`` with
    ``reason``. The server-side lease is left to be released on exit (owner-checked).
    Call it on the event loop that holds the lease (for a Celery task's lease, use
    ``asynclock_celery.testing.force_loss``).
    """
    lease._backend._lose(lease, reason)


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
