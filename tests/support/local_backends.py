"""Conformance providers for the backends that need no server: memory and sqlite."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import asynclock
from asynclock.backends.memory import MemoryDriver

from .spec import BackendSpec


async def _sabotage_memory(backend: asynclock.Backend, name: str) -> None:
    driver = backend.driver
    assert isinstance(driver, MemoryDriver)
    driver.leases.pop(name, None)


@pytest.fixture(scope="session")
def spec_memory() -> BackendSpec:
    return BackendSpec("memory", "memory://", _sabotage_memory, multiprocess=False)


@pytest.fixture(scope="session")
def spec_sqlite(tmp_path_factory: pytest.TempPathFactory) -> BackendSpec:
    path = tmp_path_factory.mktemp("sqlite") / "locks.db"

    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        conn = sqlite3.connect(path, isolation_level=None, timeout=5)
        try:
            # Expire the row behind the holder's back (rows are never deleted: they keep the
            # token counter).
            conn.execute("UPDATE asynclock_lease SET expires_at = 0 WHERE name = ?", (name,))
        finally:
            conn.close()

    async def queued(name: str) -> int:
        conn = sqlite3.connect(path, isolation_level=None, timeout=5)
        try:
            row = conn.execute("SELECT count(*) FROM asynclock_waiter WHERE name = ?", (name,))
            return int(row.fetchone()[0])
        finally:
            conn.close()

    return BackendSpec("sqlite", f"sqlite:///{Path(path).as_posix()}", sabotage, queued=queued)
