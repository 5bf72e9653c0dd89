"""Claims benchmark: rows claimed and completed per second by 1, 4 and 8 worker processes.

Rows, side by side in one run against one server, for each number of workers:

* hand-written: the usual SKIP LOCKED loop on raw asyncpg: ``UPDATE … WHERE id IN
  (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING id``, then ``UPDATE … SET status =
  'done' WHERE id = $1`` per row (no token, no heartbeat, completion checks the id only);
* guarantee floor: the hand-written loop plus the least claims' guarantees need (a token
  per row, the completion fenced on it, the claim and each completion shielded, each
  row's work in a cancel scope of its own), still on raw asyncpg: what no claims library
  with these guarantees can undercut in Python;
* asynclock: ``async with claims.take(limit=n) as batch:`` and, per row, ``async with
  job: await job.complete(result=…)`` (a claim token per row from the shared token
  source, a lease per row renewed in one statement per heartbeat, completion fenced on
  the token);
* asynclock with ``await job.complete_later(result=…)``: the same, the batch's
  completions sent together at its end (one pipelined, atomic round trip, each fenced on
  its own token, plus one read of the rows' states).

Each worker is a process; the clock runs from the moment every worker is connected until
the last one finds the table drained. ``--rows`` rows per run (default 10,000: the 8 x
10,000 case of issue 25 is ``--workers 8``). Every run checks that each row was completed
exactly once (by the ids the workers report; it stops if not) and prints each worker's
wait: the time from finishing a row to holding the next, i.e. inside the claim statement.

Then, unless ``--quick`` trims them:

* heartbeat statements per worker per interval, for batches of 1, 10 and 100 claimed
  rows: the renewal statement's calls counted by ``pg_stat_statements`` (preloaded in the
  server this script starts; with ``--url``, if the extension is installed) over the
  backend's renewal rounds (``backend.stats()``);
* table size after ``--size-rows`` claims (default 100,000): ``pg_total_relation_size``
  after the insert, after the run, after a plain ``VACUUM`` and after ``VACUUM FULL``
  (the rows alone), with the dead tuples and autovacuum runs, for both kinds;
* ``--faults N`` (off by default; 100 in the published run): N trials of a worker
  SIGSTOPped inside a row's work (10 workers in parallel): its row is reclaimed by the
  parent, completed, and the worker resumed; its late completion must be refused. Prints
  the accepted late completions (must be 0) and the time from the freeze to the reclaim
  (bound: ttl + one heartbeat).

By default the script starts a throwaway PostgreSQL (fsync off); ``--url`` uses your server.

Usage (as a module, or as a script: ``python benchmarks/bench_claims.py``)::

    flock -x /tmp/asynclock-cpu.lock uv run python -m benchmarks.bench_claims \\
        [--rows N] [--workers 1,4,8] [--limit 50] [--repeat 3] [--faults 100] [--quick]
        [--url ...]

This is a comparison table, not a pass/fail test (but it stops if a row is completed
twice or a late completion is accepted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import uuid
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock
from asynclock._harness import WorkerGroup
from asynclock._harness.pg_server import running_pg
from benchmarks._claims_workers import FAULT_TTL, TTL, worker

SCRIPT = os.path.abspath(__file__)


# -- the parent -----------------------------------------------------------------------------

#: The renewal statement of claims.py (its text as pg_stat_statements normalises it).
HEARTBEAT_SQL = "%WITH ORDINALITY AS u(id, token, ttl_ms, i)%"


async def make_table(url: str, rows: int) -> str:
    table = f"bench_claims_{uuid.uuid4().hex[:8]}"
    async with asynclock.connect(url) as backend:
        await backend.claims(table, ttl=TTL).create_table()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"INSERT INTO {table} (payload) SELECT NULL FROM generate_series(1, $1)", rows
        )
    finally:
        await conn.close()
    return table


async def sizes(conn: asyncpg.Connection, table: str) -> dict[str, int]:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    row = await conn.fetchrow(
        """SELECT pg_total_relation_size(relid) AS size, n_live_tup AS live, n_dead_tup AS dead,
                  n_tup_upd AS upd, n_tup_hot_upd AS hot, autovacuum_count AS autovacuums
           FROM pg_stat_user_tables WHERE relname = $1""",
        table,
    )
    return dict(row.items())


async def pgqueuer_jobs(url: str, rows: int) -> str:
    """Enqueue ``rows`` jobs for pgqueuer (its schema installed once); the entrypoint's
    name plays the table's part."""
    from pgqueuer import AsyncpgDriver, Queries  # the peer: the bench dependency group

    entrypoint = f"bench_claims_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        if not await queries.schema_is_installed():
            await queries.install()
        await queries.enqueue(
            [entrypoint] * rows, [str(n).encode() for n in range(1, rows + 1)], [0] * rows
        )
    finally:
        await conn.close()
    return entrypoint


async def one_run(
    url: str, kind: str, workers: int, rows: int, limit: int, *, measure_size: bool = False
) -> dict[str, Any]:
    if kind == "pgqueuer":
        table = await pgqueuer_jobs(url, rows)
    else:
        table = await make_table(url, rows)
    conn = await asyncpg.connect(url)
    out: dict[str, Any] = {}
    try:
        if kind == "guarantee-floor":
            await conn.execute(f"CREATE SEQUENCE {table}_tokens")
        if measure_size:
            await conn.execute(f"VACUUM ANALYZE {table}")
            out["before"] = await sizes(conn, table)
        async with WorkerGroup() as group:
            procs = []
            for _ in range(workers):
                cfg = {"kind": kind, "url": url, "table": table, "limit": limit}
                procs.append(
                    await group.start(
                        [SCRIPT, "--worker", json.dumps(cfg)],
                        label=f"{kind} worker",
                        timeout=600,
                    )
                )
            for p in procs:
                await p.expect("ready")
            start = time.perf_counter()
            for p in procs:
                await p.send("go")
            reports = [await p.expect("done") for p in procs]
            elapsed = time.perf_counter() - start
        ids = sorted(i for r in reports for i in r["ids"])
        if ids != list(range(1, rows + 1)):
            raise SystemExit(
                f"{kind}: {len(ids)} completions, {len(set(ids))} distinct rows of {rows}: "
                "not exactly once"
            )
        out["rate"] = rows / elapsed
        out["wait"] = max(r["wait"] for r in reports)
        out["longest"] = max(r["longest"] for r in reports)
        if measure_size:
            out["after"] = await sizes(conn, table)
            await conn.execute(f"VACUUM {table}")
            out["vacuumed"] = await sizes(conn, table)
            await conn.execute(f"VACUUM FULL {table}")
            out["packed"] = await sizes(conn, table)
        if kind != "pgqueuer":
            await conn.execute(f"DROP TABLE {table}")
            await conn.execute(f"DROP SEQUENCE IF EXISTS {table}_tokens")
    finally:
        await conn.close()
    return out


KINDS = ("hand-written", "guarantee-floor", "asynclock", "asynclock-later", "pgqueuer")


async def median_runs(
    url: str, workers: int, rows: int, limit: int, repeat: int
) -> dict[str, dict[str, Any]]:
    """Each kind's run with the median rate of ``repeat`` rounds; a round runs every kind
    once, in turn, so a slow minute of a shared machine falls on all of them."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for _ in range(repeat):
        for kind in KINDS:
            runs[kind].append(await one_run(url, kind, workers, rows, limit))
    return {kind: sorted(got, key=lambda r: r["rate"])[len(got) // 2] for kind, got in runs.items()}


async def throughput(url: str, workers: list[int], rows: int, limit: int, repeat: int) -> None:
    print(
        f"\n{rows} rows per run, take/claim limit {limit}, median of {repeat} rounds; every "
        "run: each row completed once"
    )
    print(
        f"{'workers':>7} {'hand-written rows/s':>20} {'guarantee floor':>16} {'ratio':>6}"
        f" {'asynclock rows/s':>17} {'ratio':>6} {'/floor':>6}"
        f" {'complete_later rows/s':>22} {'ratio':>6}"
        f" {'asynclock wait/worker':>22} {'longest wait':>13} {'pgqueuer jobs/s':>16}"
    )
    for n in workers:
        got = await median_runs(url, n, rows, limit, repeat)
        raw, floor, ours = got["hand-written"], got["guarantee-floor"], got["asynclock"]
        later, peer = got["asynclock-later"], got["pgqueuer"]
        print(
            f"{n:7d} {raw['rate']:20.0f} {floor['rate']:16.0f} {floor['rate'] / raw['rate']:6.2f}"
            f" {ours['rate']:17.0f} {ours['rate'] / raw['rate']:6.2f}"
            f" {ours['rate'] / floor['rate']:6.2f}"
            f" {later['rate']:22.0f} {later['rate'] / raw['rate']:6.2f}"
            f" {ours['wait'] * 1000:19.0f} ms {ours['longest'] * 1000:10.1f} ms"
            f" {peer['rate']:16.0f}",
            flush=True,
        )


async def heartbeats(url: str, admin_url: str, seconds: float) -> None:
    """Renewal statements per worker per heartbeat interval, for 1, 10 and 100 claimed rows."""
    admin = await asyncpg.connect(admin_url)
    try:
        try:
            await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await admin.execute("SELECT pg_stat_statements_reset()")
        except asyncpg.PostgresError as exc:
            print(f"\nheartbeat statements: pg_stat_statements unavailable ({exc})")
            return
        ttl = 0.6
        table = await make_table(url, 100)
        print(f"\nheartbeat: one worker, ttl {ttl:g}s (renewal every {ttl / 3:g}s), {seconds:g}s")
        print(
            f"{'claimed rows':>12} {'intervals':>9} {'renewal statements':>19} {'per interval':>12}"
        )
        for batch in (1, 10, 100):
            await admin.execute("SELECT pg_stat_statements_reset()")
            async with asynclock.connect(url) as backend:
                claims = backend.claims(table, ttl=ttl)
                async with claims.take(limit=batch) as got:
                    assert len(got) == batch
                    await anyio.sleep(seconds)  # the heartbeats run meanwhile
                # Every round of this backend (it held nothing else), over the same window
                # as the statements: from the reset to the batch's end.
                rounds = backend.stats().renewal_round_trips
            calls = int(
                await admin.fetchval(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query LIKE $1",
                    HEARTBEAT_SQL,
                )
            )
            print(f"{batch:12d} {rounds:9d} {calls:19d} {calls / max(rounds, 1):12.2f}", flush=True)
        await admin.execute(f"DROP TABLE {table}")
    finally:
        await admin.close()


async def table_sizes(url: str, rows: int, workers: int, limit: int) -> None:
    mb = 1024 * 1024
    print(f"\ntable size: {rows} rows claimed and completed once by {workers} workers")
    print(
        f"{'kind':>12} {'after insert':>12} {'after run':>10} {'dead rows':>10}"
        f" {'autovacuums':>11} {'after VACUUM':>12} {'rows alone':>10} {'run/alone':>9}"
    )
    for kind in ("hand-written", "asynclock"):
        got = await one_run(url, kind, workers, rows, limit, measure_size=True)
        b, a, v, f = got["before"], got["after"], got["vacuumed"], got["packed"]
        print(
            f"{kind:>12} {b['size'] / mb:9.1f} MB {a['size'] / mb:7.1f} MB {a['dead']:10d}"
            f" {a['autovacuums']:11d} {v['size'] / mb:9.1f} MB {f['size'] / mb:7.1f} MB"
            f" {a['size'] / f['size']:9.2f}",
            flush=True,
        )


async def faults(url: str, trials: int, parallel: int = 10) -> None:
    """``--faults``: SIGSTOP a worker inside a row's work, ``trials`` times (``parallel``
    workers at once); the parent reclaims and completes the row, then resumes the worker."""
    parallel = min(parallel, trials)
    table = await make_table(url, trials)
    shares = [trials // parallel + (k < trials % parallel) for k in range(parallel)]
    results: list[str] = []
    delays: list[float] = []

    async def drive(backend: asynclock.Backend, proc: Any, n: int) -> None:
        for _ in range(n):
            claimed = await proc.expect("claimed")
            proc.pause()
            await proc.wait_stopped(10)
            frozen_at = time.perf_counter()
            claims = backend.claims(table, ttl=FAULT_TTL, where=f"id = {claimed['id']}")
            while True:
                async with claims.take() as batch:
                    if batch:
                        (job,) = batch
                        assert job.token > claimed["token"]
                        await job.complete(result='"reclaimer"')
                        break
                await anyio.sleep(0.01)  # polling the row until its claim expires
            delays.append(time.perf_counter() - frozen_at)
            proc.resume()
            await proc.send("go")
            results.append((await proc.expect("finished", timeout=30))["result"])

    async with asynclock.connect(url) as backend, WorkerGroup() as group:
        procs = [
            await group.start(
                [SCRIPT, "--worker", json.dumps(cfg)], label="frozen worker", timeout=600
            )
            for cfg in (
                {"kind": "frozen", "url": url, "table": table, "trials": n, "k": k, "of": parallel}
                for k, n in enumerate(shares)
            )
        ]
        async with anyio.create_task_group() as tg:
            for proc, n in zip(procs, shares, strict=True):
                tg.start_soon(drive, backend, proc, n)
    conn = await asyncpg.connect(url)
    try:
        late = await conn.fetchval(f"SELECT count(*) FROM {table} WHERE result = '\"late\"'")
        done = await conn.fetchval(f"SELECT count(*) FROM {table} WHERE result = '\"reclaimer\"'")
        await conn.execute(f"DROP TABLE {table}")
    finally:
        await conn.close()
    accepted = results.count("accepted")
    delays.sort()
    bound = FAULT_TTL * (1 + 1 / 3)
    print(
        f"\nfaults: {trials} trials of a worker SIGSTOPped mid-row (ttl {FAULT_TTL:g}s, "
        f"{parallel} workers at once)"
    )
    print(
        f"late completions accepted: {accepted} (rows written by a late worker: {late}); "
        f"rows completed by the reclaimer: {done}/{trials}"
    )
    print(
        "the resumed worker saw: "
        + ", ".join(f"{r} {results.count(r)}" for r in ("refused", "lost", "unavailable"))
    )
    print(
        f"freeze -> reclaimed: median {delays[len(delays) // 2]:.2f}s, max {delays[-1]:.2f}s "
        f"(bound ttl + one heartbeat: {bound:.2f}s, plus the 10 ms poll)"
    )
    if accepted or late or done != trials:
        raise SystemExit("a late completion was accepted (or a row was not reclaimed)")


async def bench(args: argparse.Namespace, url: str, admin_url: str) -> None:
    workers = [int(n) for n in args.workers.split(",")]
    await throughput(url, workers, args.rows, args.limit, args.repeat)
    await heartbeats(url, admin_url, 1.2 if args.quick else 2.0)
    await table_sizes(url, args.size_rows, max(workers), args.limit)
    if args.faults:
        await faults(url, args.faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, help="rows per throughput run (10,000)")
    parser.add_argument("--workers", help="comma-separated worker counts (1,4,8)")
    parser.add_argument("--limit", type=int, default=50, help="rows per claim")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds per cell, the median printed (1)"
    )
    parser.add_argument("--size-rows", type=int, help="claims for the table size (100,000)")
    parser.add_argument("--faults", type=int, default=0, help="SIGSTOP trials (0: none)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--url", help="use this server instead of starting one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        anyio.run(worker, json.loads(args.worker))
        return
    args.rows = args.rows or (2_000 if args.quick else 10_000)
    args.workers = args.workers or ("1,8" if args.quick else "1,4,8")
    args.size_rows = args.size_rows or (5_000 if args.quick else 100_000)
    print(f"Python {platform.python_version()}, asyncpg {asyncpg.__version__}")
    with contextlib.ExitStack() as stack:
        if args.url:
            url = admin_url = args.url
        else:
            server = stack.enter_context(
                running_pg(extra_conf="shared_preload_libraries = 'pg_stat_statements'\n")
            )
            url, admin_url = server.url(), server.admin_url
        anyio.run(bench, args, url, admin_url)


if __name__ == "__main__":
    main()
