"""The life of a claim on the session's hook (issue 38: a lost claim's body starts, a refused
completion strands the row, a half-made table, claims invisible to stats and operators)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock.backends.postgres.claims import index_name
from asynclock.testing import force_loss
from tests.backends.test_postgres_claims import (
    MODES,
    make_jobs,
    reclaim,
    rows,
    start,
    url_for,
)
from tests.support.pg_servers import PgServer

pytestmark = pytest.mark.anyio


# -- 1. a lost claim's body never starts -----------------------------------------------------


async def test_a_frozen_workers_next_claim_never_starts_its_body(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """A worker frozen (SIGSTOP) past its claim's ttl, its row reclaimed and completed by
    another, resumes and enters ``async with claim:``: LeaseLost there, and the body's
    first statement (an INSERT it would send before any cancellation could reach it)
    never reaches the database."""
    effects = f"effects_{uuid.uuid4().hex[:8]}"
    await conn.execute(f"CREATE TABLE {effects} (row_id bigint, pid int)")
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=1)
        await make_jobs(claims, conn, 1)
        with anyio.fail_after(30):
            from asynclock._harness import WorkerGroup

            async with WorkerGroup() as group, AsyncExitStack() as stack:
                frozen = await start(
                    group, pg_server, mode="enter", table=table, ttl=1, effects=effects
                )
                claimed = await frozen.expect("claimed")
                frozen.pause()
                await frozen.wait_stopped(5)
                (item,) = await reclaim(backend, table, claimed["ids"], 10, stack)
                async with item:
                    await item.complete(result='"reclaimer"')
                frozen.resume()
                await frozen.send("go")
                finished = await frozen.expect("finished")
                (result,) = finished["results"]
                assert result.startswith("lost:"), result
                assert await frozen.wait() == 0
    assert await conn.fetchval(f"SELECT count(*) FROM {effects}") == 0
    (row,) = await rows(conn, table)
    assert (row["status"], row["result"]) == ("done", '"reclaimer"')


@pytest.mark.parametrize("mode", MODES)
async def test_entering_a_claim_lost_by_force_loss_never_runs_the_body(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    ran = False
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 2)
        with anyio.fail_after(20):
            async with claims.take(limit=2) as batch:
                first, second = batch
                force_loss(first, "forced by the test")
                with pytest.raises(asynclock.LeaseLost, match="forced by the test"):
                    async with first:
                        ran = True  # pragma: no cover
                async with second:  # the other claim of the batch is unaffected
                    assert asynclock.current_lease() is second.lease
                    await second.complete(result='"ok"')
    assert not ran
    assert [r["status"] for r in await rows(conn, table)] == ["ready", "done"]


# -- 2. a refused completion leaves the claim held ------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_a_completion_the_database_refuses_leaves_the_claim_held(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    """A CHECK constraint (and a value of the wrong type for jsonb) refuses complete(): the
    database's error reaches the caller unchanged, the claim stays held and renewed, and
    fail() then records the error and gives the row back."""
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        claims = backend.claims(table, ttl=1.5)
        await make_jobs(claims, conn, 1)
        await conn.execute(f'ALTER TABLE "{table}" ADD COLUMN score int CHECK (score >= 0)')
        with anyio.fail_after(20):
            async with claims.take() as batch:
                (item,) = batch
                async with item:
                    with pytest.raises(asyncpg.CheckViolationError):
                        await item.complete(score=-1)
                    with pytest.raises(asyncpg.PostgresError, match="json"):
                        await item.complete(result="not json")
                    # Still ours, and still renewed: a few rounds past its ttl.
                    for _ in range(5):
                        await asynclock.testing.next_renewal_round(backend)
                    assert not item.lost
                    assert await item.fail("the score was negative", retry_in=0) is False
    (row,) = await rows(conn, table)
    assert (row["status"], row["last_error"]) == ("ready", "the score was negative")
    assert backend.stats().losses == 0


@pytest.mark.parametrize("mode", MODES)
async def test_a_refused_completion_left_to_the_block_goes_back_with_its_error(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 1)
        await conn.execute(f'ALTER TABLE "{table}" ADD COLUMN score int CHECK (score >= 0)')
        with anyio.fail_after(20):
            with pytest.raises(asyncpg.CheckViolationError):
                async with claims.take() as batch:
                    (item,) = batch
                    async with item:
                        await item.complete(score=-1)
    (row,) = await rows(conn, table)
    assert row["status"] == "ready"
    assert row["last_error"].startswith("CheckViolationError: ")


# -- 3. create_table: every legal name, one index each, all or nothing ----------------------


async def test_a_59_byte_non_ascii_table_name_works(
    pg_server: PgServer, conn: asyncpg.Connection
) -> None:
    name = "tche_" + "é" * 26 + uuid.uuid4().hex[:2]  # 5 + 52 + 2 = 59 bytes
    assert len(name.encode()) == 59
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(name, ttl=5)
        await make_jobs(claims, conn, 1)
        async with claims.take() as batch:
            (item,) = batch
            async with item:
                await item.complete()
        indexes = await conn.fetchval(
            "SELECT count(*) FROM pg_indexes WHERE tablename = $1 AND indexname LIKE '%claims'",
            name,
        )
    assert indexes == 1


async def test_tables_sharing_their_first_40_characters_each_get_an_index(
    pg_server: PgServer, conn: asyncpg.Connection
) -> None:
    stem = "x" * 40 + uuid.uuid4().hex[:6]
    names = [stem + "_a", stem + "_b"]
    async with asynclock.connect(pg_server.url()) as backend:
        for name in names:
            await backend.claims(name, ttl=5).create_table()
        found = await conn.fetch(
            "SELECT tablename, indexname FROM pg_indexes WHERE tablename = ANY($1::text[]) "
            "AND indexname LIKE '%claims'",
            names,
        )
    assert sorted(r["tablename"] for r in found) == names
    assert len({r["indexname"] for r in found}) == 2
    assert {index_name(f'"{n}"').strip('"') for n in names} == {r["indexname"] for r in found}


async def test_ensure_columns_is_all_or_nothing(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """A table whose `status` is an int: the claiming index cannot be made, so nothing is
    (no claim column added before the failure stays behind)."""
    await conn.execute(f'CREATE TABLE "{table}" (id bigint PRIMARY KEY, status int)')
    async with asynclock.connect(pg_server.url()) as backend:
        with pytest.raises(ValueError, match="ensure_columns failed"):
            await backend.claims(table, ttl=5).ensure_columns()
    columns = await conn.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_name = $1", table
    )
    assert sorted(r["column_name"] for r in columns) == ["id", "status"]


# -- 4. claims seen by stats, advice, the CLI and force_loss --------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_completed_claims_count_as_released_with_hold_times(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        backend.collect_advice()
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 12)
        async with claims.take(limit=12) as batch:
            assert backend.stats().held == 12
            for item in list(batch)[:10]:
                async with item:
                    await item.complete()
        stats = backend.stats()
        assert (stats.acquired, stats.released, stats.losses, stats.held) == (12, 12, 0, 0)
        assert stats.hold_times.count == 12
        assert backend.advise("claim:*").samples == 12


@pytest.mark.parametrize("mode", MODES)
async def test_the_cli_shows_a_claimed_row_and_a_stuck_one(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    url = url_for(pg_server, mode)

    def holder(name: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "asynclock._cli", "holder", name, "--url", url, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode in (0, 1), out.stderr
        return dict(json.loads(out.stdout))

    async with asynclock.connect(url) as backend:
        claims = backend.claims(table, ttl=30, identity="worker-7")
        await make_jobs(claims, conn, 2)
        async with claims.take() as batch:
            (item,) = batch
            seen = await anyio.to_thread.run_sync(holder, f"claim:{table}:{item.id}")
            assert seen["held"] and seen["owner"] == "worker-7" and seen["token"] == item.token
            assert 0 < float(seen["ttl_left"]) <= 30  # type: ignore[arg-type]
            assert "claimed row of table" in str(seen["detail"])
            free = await anyio.to_thread.run_sync(holder, f"claim:{table}:2")
            assert not free["held"]
            # A stuck row: claimed, its claim expired and never renewed (a dead worker).
            await conn.execute(
                f"UPDATE \"{table}\" SET status = 'claimed', claim_token = 1, "
                "claimed_by = 'dead-worker', claim_expires = now() - interval '1 minute' "
                "WHERE id = 2"
            )
            stuck = await anyio.to_thread.run_sync(holder, f"claim:{table}:2")
            assert stuck["owner"] == "dead-worker" and "STUCK" in str(stuck["detail"])
            await item.complete()
