"""A tiny job queue on your own PostgreSQL table: claims, fenced completion, retries.

Three workers (three backends, as three processes would be) drain 20 jobs from the table
``example_jobs``: each takes up to 5 rows at a time with ``FOR UPDATE SKIP LOCKED``, works
on each row inside ``async with job:`` (cancelled if the claim is lost), and completes it
with a write that only lands while the row still carries the claim's token. Job 7 fails on
its first attempt and is retried; a late completion of a reclaimed row is refused. Then a
worker completes 10 more jobs with ``complete_later``: each batch's completions go out
together when its block ends, each still fenced on its own token.

Run against any PostgreSQL you can create tables in (the URL from argv or $ASYNCLOCK_PG_URL):

    uv run python examples/claims_queue.py postgresql://user:password@localhost/db
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock

TABLE = "example_jobs"


async def worker(url: str, name: str, done: list[int]) -> None:
    async with asynclock.connect(url) as backend:
        jobs = backend.claims(TABLE, ttl=10, identity=name)
        while True:
            async with jobs.take(limit=5) as batch:
                if not batch:
                    return  # nothing claimable (a real worker would sleep or LISTEN)
                for job in batch:
                    n = json.loads(job.row["payload"])["n"]
                    async with job:  # the row's work; cancelled if its claim is lost
                        if n == 7 and job.row["attempts"] == 1:
                            await job.fail("flaky dependency", retry_in=0)
                            continue
                        await job.complete(result=json.dumps(n * n))
                        done.append(job.id)


async def main(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        async with asynclock.connect(url) as backend:
            await backend.claims(TABLE, ttl=10).create_table()
        await conn.execute(
            f"INSERT INTO {TABLE} (payload) "
            "SELECT jsonb_build_object('n', g) FROM generate_series(1, 20) g"
        )
        done: list[int] = []
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(worker, url, f"worker-{i}", done)
        rows = await conn.fetch(f"SELECT id, status, attempts, result FROM {TABLE} ORDER BY id")
        print(f"{len(rows)} jobs, all done: {all(r['status'] == 'done' for r in rows)}")
        print(f"each completed once: {sorted(done) == [r['id'] for r in rows]}")
        print(f"job 7: attempts {rows[6]['attempts']}, result {rows[6]['result']}")

        # Completions deferred to the batch: one round trip per batch, not one per row.
        await conn.execute(
            f"INSERT INTO {TABLE} (payload) "
            "SELECT jsonb_build_object('n', g) FROM generate_series(101, 110) g"
        )
        async with asynclock.connect(url) as backend:
            jobs = backend.claims(TABLE, ttl=10)
            while True:
                async with jobs.take(limit=5) as batch:
                    if not batch:
                        break
                    for job in batch:
                        async with job:
                            n = json.loads(job.row["payload"])["n"]
                            await job.complete_later(result=json.dumps(n * n))
                # (the block's end wrote the 5 completions; a refused one raises StaleToken)
        left = await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE status <> 'done'")
        print(f"10 more jobs completed in batches, rows not done: {left}")

        # A worker frozen past its ttl: its row is reclaimed (a larger token), and its late
        # completion is refused. Here we play both workers by hand.
        late_id = await conn.fetchval(
            f"INSERT INTO {TABLE} (payload) VALUES ('{{\"n\": 21}}') RETURNING id"
        )
        async with asynclock.connect(url) as a, asynclock.connect(url) as b:
            async with a.claims(TABLE, ttl=10).take() as first:
                (old,) = first
                # ... worker a freezes; its claim expires on the server:
                await conn.execute(
                    f"UPDATE {TABLE} SET claim_expires = now() - interval '1 s' WHERE id = $1",
                    old.id,
                )
                async with b.claims(TABLE, ttl=10).take() as second:
                    (new,) = second
                    await new.complete(result="441")
                    print(f"job {new.id} reclaimed with token {new.token} > {old.token}")
                try:
                    await old.complete(result="-1")
                except asynclock.StaleToken as exc:
                    print(f"late completion refused: {exc}")
        result = await conn.fetchval(f"SELECT result FROM {TABLE} WHERE id = $1", late_id)
        print(f"job {late_id} result: {result}")
        await conn.execute(f"DROP TABLE {TABLE}")
    finally:
        await conn.close()
    return 0


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("ASYNCLOCK_PG_URL", "")
    if not url:
        raise SystemExit(__doc__)
    raise SystemExit(anyio.run(main, url))
