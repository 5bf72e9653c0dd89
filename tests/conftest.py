"""Fixtures shared by the whole suite.

The conformance suite runs against every backend in ``BACKENDS``. Each backend id ``X``
is provided by a session fixture ``spec_X`` (returning a :class:`BackendSpec`) defined in
a plugin module listed in ``pytest_plugins``; server-backed ones start their server on a
free loopback port themselves.

Each test that uses backend ``X`` is marked ``X`` automatically, so ``pytest -m X`` or
``pytest --backend X`` runs one backend's tests alone (tests/support/selection.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

import asynclock
from tests.support import selection
from tests.support.procs import kill_leftovers
from tests.support.spec import BackendSpec

# redis_servers first: etcd_servers imports from it, and a plugin module imported before
# it is registered cannot have its asserts rewritten.
pytest_plugins = [
    "tests.support.redis_servers",
    "tests.support.etcd_servers",
    "tests.support.local_backends",
    "tests.support.pg_servers",
    "tests.support.zk_servers",
]

#: Every backend the conformance suite runs on (each needs a ``spec_<id>`` fixture).
BACKENDS = [
    "memory", "sqlite", "postgres", "postgres_lease", "redis", "redlock", "redis_sentinel",
    "redis_cluster", "etcd", "etcd3", "zookeeper", "zookeeper3",
]  # fmt: skip

#: Backends whose locks live inside one process (no multi-process tests for them).
IN_PROCESS_ONLY = {"memory"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=BACKENDS)
def spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.fixture(params=[b for b in BACKENDS if b not in IN_PROCESS_ONLY])
def shared_spec(request: pytest.FixtureRequest) -> BackendSpec:
    """Like ``spec``, for backends that several processes share (multi-process tests)."""
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.fixture
async def backend(spec: BackendSpec) -> AsyncIterator[asynclock.Backend]:
    async with spec.connect() as b:
        yield b


@pytest.fixture(autouse=True)
def _no_leftover_workers() -> Iterator[None]:
    yield
    kill_leftovers()


@pytest.fixture
def lock_name(request: pytest.FixtureRequest) -> str:
    """A name no other test uses (servers are shared across the session)."""
    return f"t:{request.node.name}:{uuid.uuid4().hex[:8]}"


# -- one backend's tests alone: `-m redis`, `--backend sqlite` (tests/support/selection.py) --


def pytest_addoption(parser: pytest.Parser) -> None:
    selection.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    selection.register_markers(config, BACKENDS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selection.mark_and_select(config, items, BACKENDS)
