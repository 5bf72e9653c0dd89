"""PostgreSQL semaphores serve waiters first come, first served (issue 42) through the
places in ``asynclock_permit_place``: behind PgBouncer in transaction mode as directly, on
a database whose permit table is from before the queue, and at a cost that does not grow
with the number of waiters (a grant reads index ranges of at most ``limit`` live places)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock._core.permit_store import Full
from asynclock.backends.postgres.semaphore import SQL_P_GRANT, SQL_P_LOCK, grant_key
from asynclock.backends.postgres.tokens import _name_bytes
from tests.support.permits import queued
from tests.support.pg_servers import USER, PgBouncer, PgServer

pytestmark = pytest.mark.anyio

WAIT = 30.0

#: ``asynclock_permit`` as releases before the queue created it.
OLD_PERMIT_TABLE = """
CREATE TABLE asynclock_permit (
    name bytea NOT NULL, slot integer NOT NULL, owner text NOT NULL, token bigint NOT NULL,
    expires_at timestamptz NOT NULL, lim integer NOT NULL, PRIMARY KEY (name, slot)
)
"""


@pytest.fixture
def name() -> str:
    return f"sem-queue-{uuid.uuid4().hex[:10]}"


async def places(admin: asyncpg.Connection, name: str) -> int:
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM asynclock_permit_place WHERE name = $1", _name_bytes(name)
        )
    )


async def test_waiters_keep_their_order_through_a_transaction_pooler(
    pgbouncer: PgBouncer, admin: asyncpg.Connection, name: str
) -> None:
    """Through PgBouncer (pool_mode=transaction, lease mode): a queued waiter of another
    backend is granted before a ``blocking=False`` attempt made after the release; its place
    goes with the grant; a waiter that gives up withdraws its place."""
    url = pgbouncer.url("transaction", query="?mode=lease")
    with anyio.fail_after(WAIT):
        async with asynclock.connect(url) as a, asynclock.connect(url) as b:
            sem = b.semaphore(name, 1)
            in_queue, granted, got = queued(sem), anyio.Event(), []

            async def waiter() -> None:
                async with sem.acquire(ttl=10):
                    got.append("waiter")
                    granted.set()

            async with a.semaphore(name, 1).acquire(ttl=10) as holder:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await in_queue.wait()
                    assert await places(admin, name) == 1
                    assert await holder.release() is True
                    with pytest.raises(asynclock.LockHeld):
                        async with a.semaphore(name, 1).acquire(ttl=10, blocking=False):
                            got.append("overtaker")
                    await granted.wait()
            assert got == ["waiter"]
            assert await places(admin, name) == 0

            sem = b.semaphore(name, 1)
            in_queue, scope = queued(sem), anyio.CancelScope()

            async def gives_up() -> None:
                with scope:
                    async with sem.acquire(ttl=10):
                        pytest.fail("granted while held")

            async with a.semaphore(name, 1).acquire(ttl=10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(gives_up)
                    await in_queue.wait()
                    scope.cancel()
                assert await places(admin, name) == 0


async def test_the_queue_is_added_to_a_database_from_before_it(pg_server: PgServer) -> None:
    """A database whose ``asynclock_permit`` predates the queue (and a live permit in it):
    the first grant adds the place table; a second process creating the schema again is
    harmless (every statement of it is idempotent)."""
    db = f"sem_queue_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_server.admin_url)
    try:
        await admin.execute(f"CREATE DATABASE {db} OWNER {USER}")
        url = pg_server.url(db=db)
        old = await asyncpg.connect(url)
        try:
            await old.execute(OLD_PERMIT_TABLE)
            await old.execute(
                "INSERT INTO asynclock_permit VALUES ($1, 0, 'old-holder', 7, "
                "clock_timestamp() + interval '1 hour', 2)",
                _name_bytes("n"),
            )
        finally:
            await old.close()
        with anyio.fail_after(WAIT):
            async with asynclock.connect(url) as a, asynclock.connect(url) as b:
                async with a.semaphore("n", 2).acquire(ttl=10) as permit:
                    assert permit.slot == 1
                    sem = b.semaphore("n", 2)
                    in_queue = queued(sem)
                    async with anyio.create_task_group() as tg:

                        async def waiter() -> None:
                            async with sem.acquire(ttl=10, timeout=WAIT):
                                pass

                        tg.start_soon(waiter)
                        await in_queue.wait()
                        await permit.release()
                assert [h.owner for h in await a.semaphore("n", 2).holders()] == ["old-holder"]
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        await admin.close()


def _place_reads(plan: dict[str, Any]) -> list[tuple[str, str, int]]:
    """Each node of a plan that reads ``asynclock_permit_place``: its type, index and the
    rows it read (returned or filtered out, over all its loops)."""
    found = []
    if plan.get("Relation Name") == "asynclock_permit_place":
        per_loop = plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
        rows = per_loop * max(1, plan.get("Actual Loops", 1))
        found.append((plan["Node Type"], plan.get("Index Name", ""), rows))
    for child in plan.get("Plans", []):
        found += _place_reads(child)
    return found


async def test_a_new_process_does_not_wait_for_the_grants_in_flight(
    pg_server: PgServer, admin: asyncpg.Connection, name: str
) -> None:
    """The schema of a new process (run on its first grant) takes no lock on the place table
    once it exists: a transaction holding the lock every grant holds (ROW EXCLUSIVE) does not
    hold it up (CREATE INDEX IF NOT EXISTS would wait for it: SHARE)."""
    async with asynclock.connect(pg_server.url()) as backend:
        await backend.semaphore(name, 1).holders()  # the tables exist
    async with admin.transaction():
        await admin.execute("LOCK TABLE asynclock_permit_place IN ROW EXCLUSIVE MODE")
        with anyio.fail_after(10):
            async with (
                asynclock.connect(pg_server.url()) as fresh,
                fresh.semaphore(name, 1).acquire(ttl=5, blocking=False) as permit,
            ):
                assert permit.slot == 0


@pytest.mark.parametrize("stats", ["as-is", "stale", "fresh"])
async def test_a_grant_reads_no_more_places_than_permits_free(
    pg_server: PgServer, admin: asyncpg.Connection, name: str, stats: str
) -> None:
    """2,000 live places queued and 250 lapsed ones: each grant deletes up to 100 of the
    lapsed ones; then a grant of a limit-3 semaphore, asked by the last waiter of the queue
    or by a newcomer, reads a handful of rows of the place table, not the queue (EXPLAIN
    ANALYZE of the real statement in the grant's transaction, rolled back): with the
    table's statistics as they are, stale (taken before the queue grew) or fresh."""
    key = _name_bytes(name)
    async with asynclock.connect(pg_server.url()) as backend:
        store = backend.semaphore(name, 3)._store
        await store.holders()  # creates the tables
        if stats == "stale":
            await admin.execute("ANALYZE asynclock_permit_place")
        await admin.execute(
            "INSERT INTO asynclock_permit_place (owner, name, seq, expires_at) "
            "SELECT $2 || i, $1, i, clock_timestamp() + "
            "CASE WHEN i % 9 = 0 THEN interval '-1 hour' ELSE interval '1 hour' END "
            "FROM generate_series(1, 2250) AS i",
            key,
            f"{name}:",
        )
        if stats == "fresh":
            await admin.execute("ANALYZE asynclock_permit_place")
        for _ in range(3):
            assert await store.grant("newcomer", 10.0) == Full(None)  # 3 waiters ahead
    assert await places(admin, name) == 2000
    conn = await asyncpg.connect(pg_server.url())
    try:
        for owner in [f"{name}:2249", "newcomer"]:
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute(SQL_P_LOCK, grant_key(name))
                explained = await conn.fetchval(
                    "EXPLAIN (ANALYZE, FORMAT JSON) " + SQL_P_GRANT,
                    key,
                    owner,
                    10_000.0,
                    3,
                    True,
                    1_000.0,
                )
            finally:
                await tx.rollback()
            # its own place (1), the 3 ahead, the last seq (1), the upsert's conflict (1)
            reads = _place_reads(json.loads(explained)[0]["Plan"])
            assert sum(rows for _, _, rows in reads) <= 10, (owner, reads)
    finally:
        await conn.close()
