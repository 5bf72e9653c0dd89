"""Completions deferred to the batch (``await claim.complete_later(...)``; issue 38 item 5):
one round trip for a batch's completions, each still fenced on its own token, all or
nothing when the database refuses one, and the block's end flushing them."""

from __future__ import annotations

from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
import asynclock.testing
from asynclock.backends.postgres.claims import PostgresClaimStore
from tests.backends.test_postgres_claims import (
    MODES,
    make_jobs,
    rows,
    url_for,
)
from tests.support.pg_servers import PgServer

pytestmark = pytest.mark.anyio


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The store's finishing calls, by name, as they run (a call made and closed unsent,
    as by a refused second completion, is not one)."""
    calls: list[str] = []
    for name in ("complete", "complete_many"):
        real = getattr(PostgresClaimStore, name)

        async def counted(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return await _real(self, *args)

        monkeypatch.setattr(PostgresClaimStore, name, counted)
    return calls


@pytest.mark.parametrize("mode", MODES)
async def test_a_batchs_deferred_completions_go_out_together_at_its_end(
    pg_server: PgServer,
    conn: asyncpg.Connection,
    table: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_calls(monkeypatch)
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 5)
        with anyio.fail_after(20):
            async with claims.take(limit=5) as batch:
                for job in batch:
                    async with job:
                        await job.complete_later(result=str(job.id))
                    assert "deferred" in repr(job)
                # Not written yet, still held and renewed.
                assert [r["status"] for r in await rows(conn, table)] == ["claimed"] * 5
                await asynclock.testing.next_renewal_round(backend)
                assert not any(job.lost for job in batch)
                with pytest.raises(RuntimeError, match="completes once"):
                    await job.complete_later(result="2")
                with pytest.raises(RuntimeError, match="already finished"):
                    await job.complete(result="2")
        assert calls == ["complete_many"]
        got = await rows(conn, table)
        assert [r["status"] for r in got] == ["done"] * 5
        assert [r["result"] for r in got] == ["1", "2", "3", "4", "5"]
        stats = backend.stats()
        assert (stats.acquired, stats.released, stats.losses, stats.held) == (5, 5, 0, 0)


async def test_a_deferred_completion_of_a_reclaimed_row_is_refused_and_the_rest_written(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 3)
        with anyio.fail_after(20):
            with pytest.raises(asynclock.StaleToken) as info:
                async with claims.take(limit=3) as batch:
                    for job in batch:
                        await job.complete_later(result='"mine"')
                    first, second, _ = batch
                    # Another worker's claim of row 2, behind this one's back.
                    newer = await conn.fetchval(
                        f'UPDATE "{table}" SET claim_token = claim_token + 1000 '
                        "WHERE id = 2 RETURNING claim_token"
                    )
            assert (info.value.token, info.value.current) == (second.token, newer)
            assert second.lost and not first.lost
        got = await rows(conn, table)
        assert [(r["status"], r["result"]) for r in got] == [
            ("done", '"mine"'),
            ("claimed", None),
            ("done", '"mine"'),
        ]


@pytest.mark.parametrize("mode", MODES)
async def test_a_deferred_set_the_database_refuses_writes_nothing_and_goes_back(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    """A CHECK constraint refuses one row of the set: its error reaches the caller
    unchanged from the flush, nothing of the set is written (all or nothing), and the
    claims are held again: fail() works, and the block's end gives the rest back with the
    error recorded."""
    async with asynclock.connect(url_for(pg_server, mode)) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 3)
        await conn.execute(f'ALTER TABLE "{table}" ADD COLUMN score int CHECK (score >= 0)')
        with anyio.fail_after(20):
            with pytest.raises(asyncpg.CheckViolationError):
                async with claims.take(limit=3) as batch:
                    first, second, third = batch
                    await first.complete_later(score=1)
                    await second.complete_later(score=-1)
                    await third.complete_later(score=3)
                    with pytest.raises(asyncpg.CheckViolationError):
                        await batch.flush()
                    assert not any(job.lost for job in batch)
                    assert await first.fail("retry it", retry_in=0) is False
                    await third.complete_later(score=3)
                    await second.complete_later(score=-2)  # refused again at the end
        got = await rows(conn, table)
        assert [r["status"] for r in got] == ["ready"] * 3
        assert got[0]["last_error"] == "retry it"
        assert got[1]["last_error"].startswith("CheckViolationError: ")
        assert backend.stats().losses == 0 and not backend.held()


async def test_deferred_completions_are_flushed_when_the_batch_is_cancelled(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 2)
        with anyio.fail_after(20):
            with anyio.CancelScope() as scope:
                async with claims.take(limit=2) as batch:
                    first, _ = batch
                    await first.complete_later(result='"done"')
                    scope.cancel()
                    await anyio.sleep_forever()
        got = await rows(conn, table)
        assert [(r["status"], r["result"]) for r in got] == [("done", '"done"'), ("ready", None)]


async def test_complete_later_names_a_bad_column_at_once(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=5)
        await make_jobs(claims, conn, 1)
        with anyio.fail_after(20):
            async with claims.take() as batch:
                (job,) = batch
                with pytest.raises(ValueError, match="no column 'nope'"):
                    await job.complete_later(nope=1)
                with pytest.raises(ValueError, match="cannot set 'status'"):
                    await job.complete_later(status="done")
                await job.complete_later()  # no result columns: status only
        (row,) = await rows(conn, table)
        assert row["status"] == "done"


async def test_deferred_completions_across_a_server_restart(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """PostgreSQL restarted (fast shutdown: every connection ends) between the deferrals and
    the flush, with the documented defaults: the flush goes out on a new connection and
    completes every row once (still fenced: the rows carry their claims' tokens), or says
    BackendUnavailable and leaves them claimed, to come back after the ttl; never a row
    completed without its token, never an error of another kind."""
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=30)
        await make_jobs(claims, conn, 3)
        outcome: BaseException | None = None
        with anyio.fail_after(60):
            try:
                async with claims.take(limit=3) as batch:
                    tokens = {job.id: job.token for job in batch}
                    for job in batch:
                        await job.complete_later(result='"x"')
                    await anyio.to_thread.run_sync(pg_server.restart)
            except asynclock.BackendUnavailable as exc:
                outcome = exc
    after = await asyncpg.connect(pg_server.url())
    try:
        got = await rows(after, table)
    finally:
        await after.close()
    print(f"\nflush across a restart: {'completed' if outcome is None else repr(outcome)}")
    assert [r["claim_token"] for r in got] == [tokens[r["id"]] for r in got]
    if outcome is None:
        assert [(r["status"], r["result"]) for r in got] == [("done", '"x"')] * 3
    else:
        assert {r["status"] for r in got} <= {"done", "claimed"}, got
