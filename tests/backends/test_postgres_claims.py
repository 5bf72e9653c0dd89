"""Claims (``backend.claims(table, ...)``) against a real PostgreSQL: claiming with SKIP
LOCKED, one renewal statement per table per heartbeat, fenced completion, retries and
parking, reclaiming from frozen and killed worker processes, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock._harness import Worker, WorkerGroup
from asynclock.backends.postgres import MAX_LIMIT, Claim, Claims
from asynclock.backends.postgres.claims import PostgresClaimStore
from tests.support.pg_servers import PgServer
from tests.support.procs import EVENT_TIMEOUT
from tests.support.redis_servers import wait_until

pytestmark = pytest.mark.anyio

MODES = ["session", "lease"]


def url_for(server: PgServer, mode: str) -> str:
    return server.url() + ("?mode=lease" if mode == "lease" else "")


async def make_jobs(claims: Claims, conn: asyncpg.Connection, n: int) -> None:
    await claims.create_table()
    await conn.execute(
        f'INSERT INTO "{claims.table}" (payload) '
        "SELECT jsonb_build_object('n', g) FROM generate_series(1, $1) g",
        n,
    )


async def rows(conn: asyncpg.Connection, table: str) -> list[asyncpg.Record]:
    return list(
        await conn.fetch(
            f'SELECT id, status, claim_token, attempts, result, last_error FROM "{table}" '
            "ORDER BY id"
        )
    )


# -- in one process -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_claims_complete_once_with_rising_tokens(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    with anyio.fail_after(20):
        async with asynclock.connect(url_for(pg_server, mode)) as backend:
            claims = backend.claims(table, ttl=10)
            await make_jobs(claims, conn, 5)
            async with backend.lock(f"{table}:lock", ttl=10) as lock:
                pass
            async with claims.take(limit=3) as batch:
                assert [c.id for c in batch] == [1, 2, 3]
                tokens = [c.token for c in batch]
                assert tokens == sorted(set(tokens)) and tokens[0] > lock.token
                for item in batch:
                    assert item.row["status"] == "claimed" and item.row["claim_token"] == item.token
                    async with item:
                        await item.complete(result=json.dumps(item.id))
                    with pytest.raises(RuntimeError, match="already finished"):
                        await item.complete()
            async with claims.take(limit=MAX_LIMIT) as batch:
                assert [c.id for c in batch] == [4, 5]
                assert min(c.token for c in batch) > max(tokens)
                for item in batch:
                    await item.complete()
            async with claims.take(limit=10) as batch:
                assert not batch
        got = await rows(conn, table)
        assert [r["status"] for r in got] == ["done"] * 5
        assert [r["result"] for r in got[:3]] == ["1", "2", "3"]


@pytest.mark.parametrize("mode", MODES)
async def test_one_renewal_statement_per_table_renews_every_claimed_row(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str, monkeypatch: Any
) -> None:
    """200 claimed rows (by two Claims objects of one table) and a lock: each heartbeat
    round is one call for the lock and one statement for the rows (the table's store,
    the keeper of its claimed rows, renews them all at once), which moves every row's
    expiry."""
    calls: list[int] = []
    original = PostgresClaimStore.extend

    async def counted(self: PostgresClaimStore, refs: Any) -> Any:
        calls.append(len(refs))
        return await original(self, refs)

    monkeypatch.setattr(PostgresClaimStore, "extend", counted)
    with anyio.fail_after(20):
        async with asynclock.connect(url_for(pg_server, mode)) as backend:
            session = backend._session
            claims = backend.claims(table, ttl=1.5)
            await make_jobs(claims, conn, 200)
            other = backend.claims(table, ttl=1.5)  # a second object on the same table
            async with (
                backend.lock(f"{table}:lock", ttl=1.5),
                claims.take(limit=120) as first,
                other.take(limit=120) as second,
            ):
                batch = [*first, *second]
                assert len(batch) == 200
                before = await conn.fetchval(f'SELECT min(claim_expires) FROM "{table}"')
                trips = session.stats.renewal_round_trips
                for _ in range(2):
                    await session.next_round()
                assert session.stats.renewal_round_trips - trips == 4  # lock + rows, twice
                assert calls[-2:] == [200, 200]
                after = await conn.fetchval(f'SELECT min(claim_expires) FROM "{table}"')
                assert after > before
                assert all(not item.lost for item in batch)
                # Rounds go on, one statement each, past the ttl: renewal keeps every row.
                start = anyio.current_time()
                while anyio.current_time() - start < 2:
                    await session.next_round()
                assert all(not item.lost for item in batch)
                assert all(n == 200 for n in calls)
                assert await conn.fetchval(f'SELECT bool_and(claim_expires > now()) FROM "{table}"')


@pytest.mark.parametrize("mode", MODES)
async def test_a_reclaimed_row_cancels_the_work_and_refuses_completion(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, mode: str
) -> None:
    with anyio.fail_after(20):
        async with asynclock.connect(url_for(pg_server, mode)) as backend:
            claims = backend.claims(table, ttl=1)
            await make_jobs(claims, conn, 1)
            async with claims.take() as batch:
                (item,) = batch
                # Another worker's claim, behind this one's back: a larger token on the row.
                newer = await conn.fetchval(
                    f'UPDATE "{table}" SET claim_token = claim_token + 1000, result = \'"other"\' '
                    "RETURNING claim_token"
                )
                with pytest.raises(asynclock.LeaseLost, match="renewal refused"):
                    async with item:
                        await anyio.sleep_forever()
                with pytest.raises(asynclock.StaleToken) as info:
                    await item.complete(result='"late"')
                assert info.value.token == item.token and info.value.current == newer
        (row,) = await rows(conn, table)
        assert row["result"] == '"other"' and row["status"] == "claimed"


async def test_a_claim_whose_renewals_fail_is_lost_before_the_server_expires_it(
    pg_server: PgServer, conn: asyncpg.Connection, table: str, monkeypatch: Any
) -> None:
    """G3 for claims: renewals that get no answer are retried until the local deadline,
    which comes before the row's claim_expires on the server: the work is cancelled while
    no other worker can have the row yet."""

    async def no_answer(self: PostgresClaimStore, refs: Any) -> Any:
        raise OSError("no answer (test)")

    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=1.5)
            await make_jobs(claims, conn, 1)
            async with claims.take() as batch:
                (item,) = batch
                monkeypatch.setattr(PostgresClaimStore, "extend", no_answer)
                with pytest.raises(asynclock.LeaseLost, match="local deadline passed"):
                    async with item:
                        await anyio.sleep_forever()
                # The local deadline the holder was cancelled at, on the server's clock, is
                # before the row's claim_expires. (Checking claim_expires > now after the
                # block has exited raced the event loop's latency against the 20 ms between
                # the two: CI's failure under load.) The server's clock read between t0 and
                # t1 maps our deadline to at most now_server + (deadline - t0).
                expires = await conn.fetchval(
                    f'SELECT extract(epoch FROM claim_expires)::float8 FROM "{table}"'
                )
                for _ in range(50):  # a round trip short enough to bound the mapping
                    t0 = time.monotonic()
                    server = await conn.fetchval(
                        "SELECT extract(epoch FROM clock_timestamp())::float8"
                    )
                    if time.monotonic() - t0 < 0.005:
                        break
                assert server + (item.lease.deadline - t0) < expires
                monkeypatch.undo()
                await item.complete()  # nobody reclaimed it: the fence still admits it


async def test_fail_retries_later_then_parks(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=5, max_attempts=2)
            await make_jobs(claims, conn, 1)
            async with claims.take() as batch:
                (item,) = batch
                assert await item.fail(ValueError("boom"), retry_in=3600) is False
            (row,) = await rows(conn, table)
            assert (row["status"], row["attempts"], row["last_error"]) == ("ready", 1, "boom")
            async with claims.take() as batch:
                assert not batch  # not due for an hour
            await conn.execute(f'UPDATE "{table}" SET run_after = now()')
            async with claims.take() as batch:
                (item,) = batch
                assert await item.fail("boom again", retry_in=0) is True
            async with claims.take() as batch:
                assert not batch
            (row,) = await rows(conn, table)
            assert (row["status"], row["attempts"], row["last_error"]) == (
                "parked",
                2,
                "boom again",
            )


async def test_unfinished_rows_are_given_back_when_the_batch_ends(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=5)
            await make_jobs(claims, conn, 3)
            with pytest.raises(ZeroDivisionError):
                async with claims.take(limit=3) as batch:
                    first = next(iter(batch))
                    await first.complete()
                    1 / 0  # noqa: B018
            assert [r["status"] for r in await rows(conn, table)] == ["done", "ready", "ready"]
            assert not backend.held()
            async with claims.take(limit=3) as again:
                assert [c.id for c in again] == [2, 3]
                assert min(c.token for c in again) > max(c.token for c in batch)


async def test_a_take_cancelled_before_or_during_its_claim_leaves_no_row_claimed(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """G6 for claims: a take cancelled before it asks claims nothing; one cancelled while
    its claim statement runs gets the rows anyway (the statement is shielded: it may
    commit) and its batch's exit gives them back."""
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=30)
            await make_jobs(claims, conn, 4)
            entered = False
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with claims.take(limit=5):
                    entered = True
            assert not entered
            # A slow claim (pg_sleep per row) cancelled once the server is running it.
            slow = backend.claims(table, ttl=30, where="pg_sleep(0.1) IS NOT NULL")
            seen = -1

            async def take() -> None:
                nonlocal seen
                async with slow.take(limit=5) as batch:
                    seen = len(batch)
                    await anyio.sleep_forever()

            async with anyio.create_task_group() as tg:
                tg.start_soon(take)

                async def claiming() -> bool:  # the claim statement runs on the server
                    return bool(
                        await conn.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                            "AND query LIKE '%pg_sleep(0.1)%' AND pid <> pg_backend_pid()"
                        )
                    )

                await wait_until(claiming)
                tg.cancel_scope.cancel()
            assert seen == 4
            assert {r["status"] for r in await rows(conn, table)} == {"ready"}
            assert not backend.held()


async def test_a_claim_without_an_answer_within_release_timeout_raises_backend_unavailable(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """The claim statement is shielded and bounded by ``release_timeout`` (the backend's
    bound for every shielded call, no timer of its own): a claim the server takes longer
    to answer raises BackendUnavailable, saying the rows come back after the ttl; the
    backend claims again once the server answers."""
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url(), release_timeout=0.5) as backend:
            claims = backend.claims(table, ttl=30)
            await make_jobs(claims, conn, 2)
            slow = backend.claims(table, ttl=30, where="pg_sleep(1) IS NOT NULL")
            started = anyio.current_time()
            with pytest.raises(asynclock.BackendUnavailable, match=r"no answer within 0\.5s"):
                async with slow.take(limit=2):
                    raise AssertionError("unreachable: the claim got no answer")
            assert anyio.current_time() - started < 1.9  # cut at the bound, not at the end
            async with claims.take(limit=2) as batch:
                assert len(batch) == 2  # the cut claim committed nothing
                for job in batch:
                    await job.complete()
            assert not backend.held()


async def test_an_expired_claim_is_reclaimed_and_a_row_claimed_max_attempts_times_parks(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """A worker that stopped renewing (here: its claim expired on the server): the row is
    claimed again with a larger token; after max_attempts claims it is parked instead."""
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=5, max_attempts=2)
            await make_jobs(claims, conn, 1)
            expire = f"UPDATE \"{table}\" SET claim_expires = now() - interval '1 s'"
            async with claims.take() as first, claims.take() as none_yet:
                (a,) = first
                assert not none_yet  # claimed and live: skipped
                await conn.execute(expire)
                async with claims.take() as second:
                    (b,) = second
                    assert b.id == a.id and b.token > a.token
                    await conn.execute(expire)
                    async with claims.take() as third:
                        assert not third  # the second expiry parks the row instead
                    for late in (a, b):
                        with pytest.raises(asynclock.StaleToken):
                            await late.complete()
            (row,) = await rows(conn, table)
            assert row["status"] == "parked" and "expired" in row["last_error"]


async def test_ensure_columns_adds_what_an_existing_table_lacks(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    await conn.execute(f'CREATE TABLE "{table}" (id text PRIMARY KEY, body text, status text)')
    await conn.execute(f"INSERT INTO \"{table}\" (id, body) VALUES ('a', 'x'), ('b', 'y')")
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=5, where="body = 'y'")
            with pytest.raises(ValueError, match="lacks the claim columns claim_token, claimed_by"):
                async with claims.take():
                    pass
            await conn.execute(f"UPDATE \"{table}\" SET status = 'ready'")
            await claims.ensure_columns()
            async with claims.take(limit=5) as batch:
                assert [(c.id, c.row["body"]) for c in batch] == [("b", "y")]
                await next(iter(batch)).complete(body="done")
            assert await conn.fetchval(f"SELECT body FROM \"{table}\" WHERE id = 'b'") == "done"


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [
        (0, ValueError, "from 1 to 1000"),
        (-1, ValueError, "from 1 to 1000"),
        (MAX_LIMIT + 1, ValueError, "from 1 to 1000"),
        (True, TypeError, "int from 1 to 1000"),
        (2.0, TypeError, "int from 1 to 1000"),
    ],
)
async def test_bad_limits_are_refused_before_any_io(
    pg_server: PgServer, limit: object, error: type[Exception], match: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims("jobs", ttl=5)
        with pytest.raises(error, match=match):
            claims.take(limit=limit)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ttl": 0}, ValueError, "ttl"),
        ({"ttl": -1}, ValueError, "ttl"),
        ({"ttl": 10**9}, ValueError, "ttl"),
        ({"ttl": 0.001}, ValueError, "ttl"),
        ({"ttl": "5"}, TypeError, "ttl"),
        ({"ttl": 5, "max_attempts": 0}, ValueError, "max_attempts must be >= 1"),
        ({"ttl": 5, "where": "true; DROP TABLE x"}, ValueError, "without ';'"),
        ({"ttl": 5, "order_by": "id -- x"}, ValueError, "without ';' or comments"),
        ({"ttl": 5, "table": ""}, ValueError, "1 to 63 bytes"),
        ({"ttl": 5, "table": "x" * 64}, ValueError, "1 to 63 bytes"),
        ({"ttl": 5, "id_column": "a\x00b"}, ValueError, "no NUL"),
    ],
)
async def test_bad_arguments_say_what_is_allowed(
    pg_server: PgServer, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        args = {"table": "jobs", **kwargs}
        with pytest.raises(error, match=match):
            backend.claims(**args)


async def test_unknown_tables_and_injected_names_are_just_missing_tables(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    await conn.execute(f'CREATE TABLE "{table}" (id int PRIMARY KEY)')
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            for name in ["no_such_table", f'{table}"; DROP TABLE "{table}"; --', f"{table} x"]:
                with pytest.raises(ValueError, match="does not exist"):
                    async with backend.claims(name, ttl=5).take():
                        pass
            assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
            with pytest.raises(ValueError, match="no id column 'key'"):
                async with backend.claims(table, ttl=5, id_column="key").take():
                    pass


async def test_wrong_column_types_and_result_columns_are_named(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    with anyio.fail_after(20):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=5)
            await make_jobs(claims, conn, 1)
            async with claims.take() as batch:
                (item,) = batch
                with pytest.raises(ValueError, match="has no column 'nope'"):
                    await item.complete(nope=1)
                with pytest.raises(ValueError, match="cannot set 'claim_token'"):
                    await item.complete(claim_token=1)
                with pytest.raises(TypeError, match="retry_in"):
                    await item.fail("x", retry_in="soon")  # type: ignore[arg-type]
                await item.complete()
            await conn.execute(f'ALTER TABLE "{table}" ALTER claim_token TYPE text')
            with pytest.raises(ValueError, match="claim_token is text; it must be bigint"):
                async with backend.claims(table, ttl=5).take():
                    pass


@pytest.mark.parametrize("scheme", ["memory", "sqlite"])
async def test_other_backends_say_claims_need_postgresql(scheme: str, tmp_path: Path) -> None:
    url = "memory://" if scheme == "memory" else f"sqlite:///{tmp_path / 'locks.db'}"
    async with asynclock.connect(url) as backend:
        with pytest.raises(NotImplementedError, match="claims need PostgreSQL"):
            backend.claims("jobs", ttl=5)


# -- worker processes -----------------------------------------------------------------------


async def start(group: WorkerGroup, pg_server: PgServer, **cfg: Any) -> Worker:
    payload = json.dumps({"url": pg_server.url(), "parent": os.getpid(), **cfg})
    return await group.start(
        ["-m", "tests.support.claims_worker", payload],
        label=f"claims {cfg['mode']} worker",
        timeout=EVENT_TIMEOUT,
    )


#: Issue 25's "8 worker processes claim 10,000 rows", at full size: 4-5 s here (8 x 2,000
#: took ~3.7 s; most of it is starting the processes). benchmarks/bench_claims.py checks
#: exactly-once too, and times each worker's waits.
WORKERS, ROWS = 8, 10_000


async def test_eight_worker_processes_complete_each_row_once_and_never_idle_while_rows_remain(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """Each row is completed exactly once, by one worker; every worker gets a share; and
    no worker idles while rows remain: a worker waits only after a take came back empty,
    and then a probe (``FOR UPDATE SKIP LOCKED`` over the claimable rows) finds no row it
    could have had. Rows only ever leave 'ready' here, so a row free at the probe was
    free at the empty take before it: a count, not a timing, so a loaded machine cannot
    make it flaky."""
    async with asynclock.connect(pg_server.url()) as backend:
        await make_jobs(backend.claims(table, ttl=10), conn, ROWS)
    drain = {"mode": "drain", "table": table, "limit": 10, "probe": True}
    with anyio.fail_after(50):
        async with WorkerGroup() as group:
            workers = [await start(group, pg_server, **drain) for _ in range(WORKERS)]
            reports = [await w.expect("done", timeout=45) for w in workers]
    completed = [i for r in reports for i in r["completed"]]
    assert sorted(completed) == list(range(1, ROWS + 1))  # each once, by exactly one worker
    assert all(r["completed"] for r in reports), "every worker got a share"
    assert [r["missed"] for r in reports] == [0] * WORKERS, "a take came back empty-handed"
    assert all(r["empty"] >= 1 for r in reports)  # the probe ran (each ends on an empty take)
    got = await rows(conn, table)
    assert {r["status"] for r in got} == {"done"}
    by_worker = {r["id"]: r["result"] for r in got}
    for w, r in zip(workers, reports, strict=True):
        assert all(by_worker[i] == str(w.pid) for i in r["completed"])


async def reclaim(
    backend: asynclock.Backend, table: str, ids: list[int], timeout: float, stack: AsyncExitStack
) -> list[Claim]:
    """Take the rows ``ids`` (only them) once their claims have expired (polling, bounded)."""
    claims = backend.claims(table, ttl=1, where=f"id IN ({', '.join(map(str, ids))})")
    got: list[Claim] = []
    with anyio.fail_after(timeout):
        while len(got) < len(ids):
            batch = await stack.enter_async_context(claims.take(limit=len(ids)))
            got += batch
            if not batch:
                await anyio.sleep(0.05)  # a poll of the table, until the claim expires
    return got


async def test_a_frozen_worker_is_reclaimed_and_its_late_completion_refused(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """SIGSTOP a worker holding a row: after the ttl the row is claimed again with a larger
    token and completed; after SIGCONT the frozen worker's completion is refused
    (StaleToken) and writes nothing. Four trials: frozen between rows, and frozen inside
    the row's ``async with claim:`` (then the resumed worker's loss cancels the work, or,
    if it reaches complete() first, that is refused)."""
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=1)
        await make_jobs(claims, conn, 4)
        for trial in range(4):
            inside = trial % 2 == 1
            with anyio.fail_after(20):
                async with WorkerGroup() as group, AsyncExitStack() as stack:
                    frozen = await start(
                        group, pg_server, mode="hold", table=table, ttl=1, inside=inside
                    )
                    claimed = await frozen.expect("claimed")
                    assert claimed["ids"] == [trial + 1]
                    frozen.pause()
                    await frozen.wait_stopped(5)
                    (item,) = await reclaim(backend, table, claimed["ids"], 10, stack)
                    assert item.token > claimed["tokens"][0]
                    await item.complete(result='"reclaimer"')
                    frozen.resume()
                    await frozen.send("go")
                    finished = await frozen.expect("finished")
                    (result,) = finished["results"]
                    if inside and result.startswith("lost:"):
                        assert "renewal refused" in result or "deadline" in result
                    else:
                        assert result == f"stale:{item.token}"
                    assert await frozen.wait() == 0
            row = (await rows(conn, table))[trial]
            assert (row["status"], row["result"], row["claim_token"]) == (
                "done",
                '"reclaimer"',
                item.token,
            )


async def test_a_killed_workers_rows_are_reclaimed(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    async with asynclock.connect(pg_server.url()) as backend:
        claims = backend.claims(table, ttl=1)
        await make_jobs(claims, conn, 5)
        with anyio.fail_after(20):
            async with WorkerGroup() as group, AsyncExitStack() as stack:
                doomed = await start(group, pg_server, mode="hold", table=table, ttl=1, limit=5)
                claimed = await doomed.expect("claimed")
                doomed.kill()
                await doomed.wait()
                items = await reclaim(backend, table, claimed["ids"], 10, stack)
                assert sorted(i.id for i in items) == claimed["ids"] == [1, 2, 3, 4, 5]
                assert min(i.token for i in items) > max(claimed["tokens"])
                for item in items:
                    await item.complete()
        assert {r["status"] for r in await rows(conn, table)} == {"done"}


async def test_worker_processes_ride_a_server_restart_and_reclaim_after_it(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """A PostgreSQL restart (fast shutdown: every connection ends) in the middle of a run.
    Three worker processes are stopped mid-batch (after 20 rows, holding 10 claimed rows)
    while a fourth holds rows 1-5 and is frozen (SIGSTOP) across the restart. After it:
    the three reconnect and carry on (each completes rows after the restart), the frozen
    worker's rows are reclaimed after the restart with larger tokens (the run cannot end
    if reclaiming after a restart were broken: they would stay 'claimed'), every row is
    done, no completion is accepted twice, and the frozen worker's late completions are
    refused."""
    n = 600
    async with asynclock.connect(pg_server.url()) as backend:
        await make_jobs(backend.claims(table, ttl=10), conn, n)
    # ttl 5: the claims held across the restart outlive its outage (renewed afterwards).
    drain = {"mode": "drain", "table": table, "ttl": 5, "limit": 10, "gate": 20, "ride": True}
    with anyio.fail_after(30):
        async with WorkerGroup() as group:
            frozen = await start(group, pg_server, mode="hold", table=table, ttl=1, limit=5)
            held = await frozen.expect("claimed")
            assert held["ids"] == [1, 2, 3, 4, 5]
            workers = [await start(group, pg_server, **drain) for _ in range(3)]
            for w in workers:
                await w.expect("gated")
            frozen.pause()
            await frozen.wait_stopped(5)
            await conn.close()
            await anyio.to_thread.run_sync(pg_server.restart)
            after = await asyncpg.connect(pg_server.url())
            try:
                restarted = int(await after.fetchval("SELECT txid_current()"))
                for w in workers:
                    await w.send("go")
                reports = [await w.expect("done", timeout=25) for w in workers]
                frozen.resume()
                await frozen.send("go")
                late = await frozen.expect("finished")
                assert await frozen.wait() == 0
                got = await after.fetch(
                    "SELECT id, status, claim_token, result, xmin::text::bigint AS xid "
                    f'FROM "{table}" ORDER BY id'
                )
            finally:
                await after.close()
    completed = [i for r in reports for i in r["completed"]]
    assert len(completed) == len(set(completed)), "a completion was accepted twice"
    assert {r["status"] for r in got} == {"done"}
    assert {r["id"] for r in got} == set(completed) | {i for r in reports for i in r["uncertain"]}
    pids = {str(w.pid) for w in workers}
    assert {r["result"] for r in got} <= pids  # the frozen worker wrote nothing
    by_id = {r["id"]: r for r in got}
    for w, report in zip(workers, reports, strict=True):
        assert all(by_id[i]["result"] == str(w.pid) for i in report["completed"])
        after_restart = [i for i in report["completed"] if by_id[i]["xid"] > restarted]
        assert after_restart, f"worker {w.pid} did not carry on after the restart: {report}"
    for i, token in zip(held["ids"], held["tokens"], strict=True):
        row = by_id[i]
        assert row["claim_token"] > token and row["xid"] > restarted  # reclaimed afterwards
    assert "done" not in late["results"], late  # 0 late completions accepted


def test_example_claims_queue(pg_server: PgServer) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "claims_queue.py"
    done = subprocess.run(
        [sys.executable, str(example), pg_server.url()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        "20 jobs, all done: True",
        "each completed once: True",
        "job 7: attempts 2, result 49",
    ], done.stdout
    assert lines[3] == "10 more jobs completed in batches, rows not done: 0"
    assert lines[4].startswith("job 31 reclaimed with token ")
    assert lines[5].startswith("late completion refused: stale fencing token ")
    assert lines[6] == "job 31 result: 441"


async def test_the_claim_statement_finds_its_rows_by_key_not_by_scanning_the_table(
    pg_server: PgServer, conn: asyncpg.Connection, table: str
) -> None:
    """Issue 38 item 5: the claim statement's plan, generic (what a prepared statement
    settles on after five runs) and for these arguments, joins the claimed rows back by the
    primary key. It hashed the whole table once (the one-row token range estimated at
    1,330 rows made the batch look like 66,500): a sequential scan per claim, 2-6 ms per
    batch of 50 on 10,000 rows and growing with the table."""
    with anyio.fail_after(30):
        async with asynclock.connect(pg_server.url()) as backend:
            claims = backend.claims(table, ttl=30)
            await make_jobs(claims, conn, 10_000)
            async with claims.take(limit=50) as batch:  # the token range exists
                for job in batch:
                    await job.complete(result='"done"')
            store = claims._store
            assert isinstance(store, PostgresClaimStore)
            sql = (await store._resolve()).claim
        await conn.execute(f'ANALYZE "{table}"')
        for cache_mode in ("force_generic_plan", "force_custom_plan"):
            await conn.execute(f"SET plan_cache_mode = {cache_mode}")
            await conn.execute(f"PREPARE claim_{cache_mode} AS {sql}")
            run = conn.transaction()  # EXPLAIN ANALYZE runs the claim: rolled back after
            await run.start()
            try:
                plan = "\n".join(
                    r[0]
                    for r in await conn.fetch(
                        f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) EXECUTE claim_{cache_mode}"
                        "(50, 'test', 30000.0, 5)"
                    )
                )
            finally:
                await run.rollback()
            assert f"on {table} " in plan, plan  # the plan reads the table...
            assert f"Seq Scan on {table} " not in plan, plan  # ...by an index, not all of it
