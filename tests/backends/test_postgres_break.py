"""PostgreSQL mode=session ``break_lock``: it ends the holder's session, so it needs the
right to; without it the error says which right (and nothing is broken)."""

from __future__ import annotations

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from tests.support.pg_servers import PgServer

pytestmark = pytest.mark.anyio


async def test_break_lock_without_the_right_to_end_the_session(
    pg_server: PgServer, lock_name: str
) -> None:
    admin = await asyncpg.connect(pg_server.admin_url)
    try:
        await admin.execute("DROP ROLE IF EXISTS asynclock_viewer")
        await admin.execute("CREATE ROLE asynclock_viewer LOGIN PASSWORD 'viewer-pass'")
        viewer_url = pg_server.url(user="asynclock_viewer", password="viewer-pass")
        with anyio.fail_after(30):
            async with asynclock.connect(pg_server.url()) as holder_backend:
                async with holder_backend.lock(lock_name, ttl=5.0) as lease:
                    async with asynclock.connect(viewer_url) as viewer:
                        assert await viewer.locked(lock_name)  # pg_locks: readable by all
                        with pytest.raises(
                            asynclock.BackendUnavailable, match="its role or pg_signal_backend"
                        ):
                            await viewer.break_lock(lock_name)
                    assert not lease.lost
                    assert await holder_backend.validate(lock_name, lease.token)
    finally:
        await admin.execute("DROP ROLE IF EXISTS asynclock_viewer")
        await admin.close()
