"""A grant cancelled while its transaction is on the server (PostgreSQL read-write locks
and semaphores grant in one transaction serialised per name by an advisory lock): the
transaction must not stay open on the backend's pinned connection, holding the name's
advisory lock and row locks, or every later grant and release of the name, from any
process, waits behind it (seen as a CI timeout: a reader's release "timed out" and a
waiting reader was never granted)."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock.backends.postgres.rwlock import grant_key as rw_key
from asynclock.backends.postgres.semaphore import grant_key as sem_key
from tests.support.pg_servers import PgServer

pytestmark = pytest.mark.anyio


async def waiting_on_advisory_lock(admin: asyncpg.Connection) -> None:
    """Until another session waits for an advisory lock (the grant's first statement)."""
    with anyio.fail_after(10):
        while not await admin.fetchval(  # noqa: ASYNC110 (the server's state: no event)
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ):
            await anyio.sleep(0.01)


@pytest.mark.parametrize("kind", ["rwlock", "semaphore"])
async def test_a_grant_cancelled_mid_transaction_leaves_no_transaction_open(
    pg_server: PgServer, admin: asyncpg.Connection, kind: str
) -> None:
    name = f"cancelled-grant-{uuid.uuid4().hex[:10]}"
    key = rw_key(name) if kind == "rwlock" else sem_key(name)

    def hold(backend: asynclock.Backend) -> Any:
        if kind == "rwlock":
            return backend.rwlock(name).write(ttl=10, timeout=5)
        return backend.semaphore(name, 1).acquire(ttl=10, timeout=5)

    async with (
        asynclock.connect(pg_server.url()) as first,
        asynclock.connect(pg_server.url()) as other,
    ):
        async with hold(first):  # tables made, the name used once
            pass
        tx = admin.transaction()
        await tx.start()
        await admin.execute("SELECT pg_advisory_xact_lock($1)", key)
        async with anyio.create_task_group() as tg:

            async def attempt() -> None:
                async with hold(first):
                    raise AssertionError("unreachable: granted while the name was locked")

            tg.start_soon(attempt)
            await waiting_on_advisory_lock(admin)
            tg.cancel_scope.cancel()  # cancelled inside its grant's transaction
        await tx.rollback()  # the name's advisory lock free again
        with anyio.fail_after(15):
            async with hold(other):  # another process grants the name at once
                pass
            async with hold(first):  # and the cancelled backend's connection works
                pass
        assert not await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
        )
