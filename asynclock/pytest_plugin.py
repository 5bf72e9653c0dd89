"""The ``asynclock`` pytest plugin, registered through the ``pytest11`` entry point (it
loads by itself wherever asynclock is installed).

* ``lock_backend`` — an open backend in the running test's event loop, for async tests run
  by pytest-asyncio (strict or auto mode) or anyio's plugin: ``memory://`` unless
  ``pytest --asynclock-url URL`` points it at a real server.
* Fixtures an integration ships load with it when that integration's framework is
  installed: ``locked_task_runner`` (:mod:`asynclock_celery.testing`) with Celery. The
  plugin names them, it imports none of them (the core imports no integration).

Helpers to call from tests (a memory backend, ``force_loss``, a manual clock, driver
faults) are in ``asynclock.testing``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ._core.backend import Backend
from ._core.connect import connect

#: The command-line option naming the server ``lock_backend`` connects to.
URL_OPTION = "--asynclock-url"

#: Integration plugins loaded when the framework they need is installed: (module, needs).
INTEGRATION_PLUGINS = (("asynclock_celery.testing", "celery"),)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asynclock")
    group.addoption(
        URL_OPTION,
        dest="asynclock_url",
        default="memory://",
        metavar="URL",
        help="lock server for the lock_backend fixture (default: memory://)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for module, needs in INTEGRATION_PLUGINS:
        if importlib.util.find_spec(needs) is not None and not config.pluginmanager.has_plugin(
            module
        ):
            config.pluginmanager.import_plugin(module)


def backend_url(config: pytest.Config) -> str:
    """The ``--asynclock-url`` of this run (``memory://`` by default)."""
    return str(config.getoption("asynclock_url", default="memory://") or "memory://")


async def _open_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async with connect(backend_url(request.config)) as backend:
        yield backend


@pytest.fixture
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
        # pytest-asyncio sets a fixture up and tears it down in two different tasks, but a
        # backend's task group must be left in the task that entered it: one task of the
        # test's loop keeps the backend open from setup to teardown.
        import asyncio

        opened: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()

        async def keep_open() -> None:
            async with connect(backend_url(request.config)) as backend:
                opened.set_result(backend)
                await stop.wait()

        keeper = asyncio.ensure_future(keep_open())
        waits: list[asyncio.Future[Any]] = [keeper, opened]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            await keeper  # it failed to open: raise its error
        try:
            yield opened.result()
        finally:
            stop.set()
            await keeper


@pytest.fixture
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
