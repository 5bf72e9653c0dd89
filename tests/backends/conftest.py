"""Fixtures shared by the claims tests (test_postgres_claims*.py): a fresh table name and
an admin connection to the suite's PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]
import pytest

from tests.support.pg_servers import PgServer


@pytest.fixture
def table() -> str:
    return f"jobs_{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def conn(pg_server: PgServer) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(pg_server.url())
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def admin(pg_server: PgServer) -> AsyncIterator[asyncpg.Connection]:
    """A connection as the server's superuser (pg_stat_activity, pg_locks, extensions)."""
    conn = await asyncpg.connect(pg_server.admin_url)
    try:
        yield conn
    finally:
        await conn.close()
