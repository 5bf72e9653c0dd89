"""Run one backend's tests alone: a marker per backend, and ``--backend NAME``.

Every test that uses a backend gets that backend's marker automatically, so
``pytest -m redis`` or ``pytest --backend redis`` runs just those (and starts no other
backend's server: server fixtures start only for tests that run). A test uses backend ``X``
when it is parametrized with ``X`` through a spec fixture (``spec``, ``shared_spec``, any
``*_spec``: the conformance parameters), when it uses a fixture of ``X``'s (``spec_X`` or
one in ``FIXTURES``), or when it lives in ``tests/backends/test_X.py`` or ``test_X_*.py``.
A backend id with a mode suffix (``postgres_lease``) also carries its family's marker
(``postgres``), so ``-m postgres`` runs both PostgreSQL modes and ``-m postgres_lease`` only
the lease mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

#: Server fixtures that belong to one backend (beyond the ``spec_<id>`` fixtures).
FIXTURES = {
    "redis_server": "redis",
    "redis_factory": "redis",
    "redlock_servers": "redlock",
    "redis_sentinel_deployment": "redis_sentinel",
    "redis_cluster_deployment": "redis_cluster",
    "deployment_factory": "redis",
    "pg_server": "postgres",
    "pgbouncer": "postgres",
    "etcd_cluster": "etcd",
    "etcd_cluster3": "etcd3",
    "etcd_factory": "etcd",
    "zk_ensemble": "zookeeper",
    "zk_factory": "zookeeper",
    "zk_ensemble3": "zookeeper",
}


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the tests that use this backend (repeat or comma-separate for several; "
        "the same as -m NAME)",
    )


def marker_names(backends: Sequence[str]) -> list[str]:
    """Every backend id, and the family of ids with a mode suffix (postgres_lease: postgres)."""
    names = list(backends)
    for backend in backends:
        family = backend.split("_", 1)[0]
        if family not in names:
            names.append(family)
    return names


def register_markers(config: pytest.Config, backends: Sequence[str]) -> None:
    for name in marker_names(backends):
        config.addinivalue_line(
            "markers", f"{name}: uses the {name} backend (applied automatically; -m {name})"
        )


def backends_of(item: pytest.Item, backends: Sequence[str]) -> set[str]:
    """The backend ids ``item`` uses."""
    found: set[str] = set()
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        for fixture, value in callspec.params.items():
            if (fixture == "spec" or fixture.endswith("_spec")) and value in backends:
                found.add(value)
    for fixture in getattr(item, "fixturenames", ()):
        if fixture.startswith("spec_") and fixture[5:] in backends:
            found.add(fixture[5:])
        elif fixture in FIXTURES:
            found.add(FIXTURES[fixture])
    path = Path(str(item.path))
    if path.parent.name == "backends":
        for backend in backends:
            if path.stem == f"test_{backend}" or path.stem.startswith(f"test_{backend}_"):
                found.add(backend)
    return found


def mark_and_select(
    config: pytest.Config, items: list[pytest.Item], backends: Sequence[str]
) -> None:
    """Add the backend markers; with ``--backend``, deselect the tests of other backends."""
    wanted = {name for value in config.getoption("backend") for name in value.split(",") if name}
    known = marker_names(backends)
    if unknown := sorted(wanted - set(known)):
        raise pytest.UsageError(
            f"--backend {', '.join(unknown)}: no such backend; choose from {', '.join(known)}"
        )
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        names = set()
        for backend in backends_of(item, backends):
            names |= {backend, backend.split("_", 1)[0]}
        for name in sorted(names):
            item.add_marker(getattr(pytest.mark, name))
        (selected if not wanted or names & wanted else deselected).append(item)
    if wanted:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
