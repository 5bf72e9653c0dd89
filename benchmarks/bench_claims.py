"""Claims benchmark: rows claimed and completed per second by 1, 4 and 8 worker processes.

Rows, side by side in one run against one server, for each number of workers:

* hand-written: the usual SKIP LOCKED loop on raw asyncpg: ``UPDATE … WHERE id IN
  (SELECT … FOR UPDATE SKIP LOCKED LIMIT n) RETURNING id``, then ``UPDATE … SET status =
  'done' WHERE id = $1`` per row (no token, no heartbeat, completion checks the id only);
* asynclock: ``async with claims.take(limit=n) as batch:`` and, per row, ``async with
  job: await job.complete(result=…)`` (a claim token per row from the shared token
  source, a lease per row renewed in one statement per heartbeat, completion fenced on
  the token).

Each worker is a process; the clock runs from the moment every worker is connected until
the last one finds the table drained. ``--rows`` rows per run (default 10,000: the 8 x
10,000 case of issue 25 is ``--workers 8``). By default the script starts a throwaway
PostgreSQL (fsync off); ``--url`` uses your server.

Usage (as a module, or as a script: ``python benchmarks/bench_claims.py``)::

    flock -x /tmp/asynclock-cpu.lock uv run python -m benchmarks.bench_claims \\
        [--rows N] [--workers 1,4,8] [--limit 50] [--url postgresql://...]

This is a comparison table, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import uuid
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock
from asynclock._harness import WorkerGroup, emit
from asynclock._harness.pg_server import running_pg

TTL = 30.0
SCRIPT = os.path.abspath(__file__)


# -- the worker processes -------------------------------------------------------------------


async def hand_written(url: str, table: str, limit: int) -> int:
    conn = await asyncpg.connect(url)
    claim = f"""
UPDATE {table} SET status = 'claimed', claimed_by = $1,
       claim_expires = clock_timestamp() + interval '30 seconds'
WHERE id IN (SELECT id FROM {table} WHERE status = 'ready' ORDER BY id LIMIT $2
             FOR UPDATE SKIP LOCKED)
RETURNING id"""
    complete = f"UPDATE {table} SET status = 'done', result = $2 WHERE id = $1"
    done = 0
    try:
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        while rows := await conn.fetch(claim, str(os.getpid()), limit):
            for row in rows:
                await conn.execute(complete, row["id"], "1")
                done += 1
    finally:
        await conn.close()
    return done


async def with_claims(url: str, table: str, limit: int) -> int:
    done = 0
    async with asynclock.connect(url) as backend:
        claims = backend.claims(table, ttl=TTL)
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        while True:
            async with claims.take(limit=limit) as batch:
                if not batch:
                    break
                for job in batch:
                    async with job:
                        await job.complete(result="1")
                        done += 1
    return done


async def worker(cfg: dict[str, Any]) -> None:
    run = hand_written if cfg["kind"] == "hand-written" else with_claims
    emit("done", rows=await run(cfg["url"], cfg["table"], cfg["limit"]))


# -- the parent -----------------------------------------------------------------------------


async def one_run(url: str, kind: str, workers: int, rows: int, limit: int) -> float:
    table = f"bench_claims_{uuid.uuid4().hex[:8]}"
    async with asynclock.connect(url) as backend:
        await backend.claims(table, ttl=TTL).create_table()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"INSERT INTO {table} (payload) SELECT NULL FROM generate_series(1, $1)", rows
        )
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
            total = sum([(await p.expect("done"))["rows"] for p in procs])
            elapsed = time.perf_counter() - start
        assert total == rows, f"{kind}: {total} rows completed of {rows}"
        await conn.execute(f"DROP TABLE {table}")
    finally:
        await conn.close()
    return rows / elapsed


async def bench(url: str, workers: list[int], rows: int, limit: int) -> None:
    print(f"{rows} rows per run, take/claim limit {limit}")
    print(f"{'workers':>7} {'hand-written rows/s':>20} {'asynclock rows/s':>17} {'ratio':>6}")
    for n in workers:
        raw = await one_run(url, "hand-written", n, rows, limit)
        ours = await one_run(url, "asynclock", n, rows, limit)
        print(f"{n:7d} {raw:20.0f} {ours:17.0f} {ours / raw:6.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--workers", default="1,4,8", help="comma-separated worker counts")
    parser.add_argument("--limit", type=int, default=50, help="rows per claim")
    parser.add_argument("--url", help="use this server instead of starting one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        anyio.run(worker, json.loads(args.worker))
        return
    print(f"Python {platform.python_version()}, asyncpg {asyncpg.__version__}")
    workers = [int(n) for n in args.workers.split(",")]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(running_pg()).url()
        anyio.run(bench, url, workers, args.rows, args.limit)


if __name__ == "__main__":
    main()
