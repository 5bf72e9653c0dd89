"""bench_claims' worker processes: one kind of claiming loop each (the hand-written
``SKIP LOCKED`` loop, the guarantee floor, asynclock with ``complete()`` or
``complete_later()``, pgqueuer) and the ``--faults`` trials; ``bench_claims.py --worker``
runs one. See bench_claims.py for what each measures."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock
from asynclock._harness import emit

TTL = 30.0
#: The claims' ttl in ``--faults`` trials (renewed every ttl/3).
FAULT_TTL = 1.0


# -- the worker processes -------------------------------------------------------------------


class Waits:
    """A worker's waits: from finishing a row (or starting) to holding the next rows."""

    def __init__(self) -> None:
        self.total = 0.0
        self.longest = 0.0
        self._since = time.perf_counter()

    def got(self) -> None:
        gap = time.perf_counter() - self._since
        self.total += gap
        self.longest = max(self.longest, gap)

    def working(self) -> None:
        self._since = time.perf_counter()


async def hand_written(url: str, table: str, limit: int, waits: Waits) -> list[int]:
    conn = await asyncpg.connect(url)
    claim = f"""
UPDATE {table} SET status = 'claimed', claimed_by = $1,
       claim_expires = clock_timestamp() + interval '30 seconds'
WHERE id IN (SELECT id FROM {table} WHERE status = 'ready' ORDER BY id LIMIT $2
             FOR UPDATE SKIP LOCKED)
RETURNING id"""
    complete = f"UPDATE {table} SET status = 'done', result = $2 WHERE id = $1"
    done: list[int] = []
    try:
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        waits.working()
        while rows := await conn.fetch(claim, str(os.getpid()), limit):
            waits.got()
            for row in rows:
                await conn.execute(complete, row["id"], "1")
                done.append(row["id"])
            waits.working()
    finally:
        await conn.close()
    return done


async def guarantee_floor(url: str, table: str, limit: int, waits: Waits) -> list[int]:
    """The hand-written loop plus the least the claims' guarantees need, on raw asyncpg:
    a token per claimed row (from a sequence, after the row lock), the completion fenced
    on it (``… AND claim_token = $2 AND status = 'claimed' RETURNING``; refused: the
    worker stops), the claim and each completion in a shielded cancel scope (G6: a call
    on its way is not cut short), each row's work in a cancel scope of its own (G4: the
    scope a loss cancels). No lease, heartbeat or deadline: the floor under claims."""
    conn = await asyncpg.connect(url)
    seq = f"{table}_tokens"  # made by one_run
    claim = f"""
UPDATE {table} SET status = 'claimed', claimed_by = $1, claim_token = nextval('{seq}'),
       claim_expires = clock_timestamp() + interval '30 seconds'
WHERE id IN (SELECT id FROM {table} WHERE status = 'ready' ORDER BY id LIMIT $2
             FOR UPDATE SKIP LOCKED)
RETURNING id, claim_token"""
    complete = f"""UPDATE {table} SET status = 'done', result = $3
WHERE id = $1 AND claim_token = $2 AND status = 'claimed' RETURNING status"""
    done: list[int] = []
    try:
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        waits.working()
        while True:
            with anyio.CancelScope(shield=True):
                rows = await conn.fetch(claim, str(os.getpid()), limit)
            if not rows:
                break
            waits.got()
            for row in rows:
                with anyio.CancelScope():
                    with anyio.CancelScope(shield=True):
                        status = await conn.fetchval(complete, row["id"], row["claim_token"], "1")
                    if status is None:
                        raise SystemExit(f"floor: row {row['id']} refused its own completion")
                    done.append(row["id"])
            waits.working()
    finally:
        await conn.close()
    return done


async def with_claims(
    url: str, table: str, limit: int, waits: Waits, *, later: bool = False
) -> list[int]:
    """``later``: each completion deferred to the batch (``complete_later``): one fenced
    round trip per batch instead of one per row."""
    done: list[int] = []
    async with asynclock.connect(url) as backend:
        claims = backend.claims(table, ttl=TTL)
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        waits.working()
        while True:
            async with claims.take(limit=limit) as batch:
                if not batch:
                    break
                waits.got()
                for job in batch:
                    async with job:
                        if later:
                            await job.complete_later(result="1")
                        else:
                            await job.complete(result="1")
                        done.append(job.id)
            waits.working()
    return done


async def with_pgqueuer(url: str, table: str, limit: int, waits: Waits) -> list[int]:
    """pgqueuer's worker: a QueueManager in drain mode (it stops once the queue is empty),
    one entrypoint that records the job (its payload is the row number). ``waits`` is
    not measured here (pgqueuer's loop is its own)."""
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    conn = await asyncpg.connect(url)
    done: list[int] = []
    try:
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint(table)
        async def job(job: Any) -> None:
            done.append(int(job.payload))

        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        await qm.run(batch_size=limit, mode=QueueExecutionMode.drain)
    finally:
        await conn.close()
    return done


async def frozen_trials(url: str, table: str, trials: int, k: int, of: int) -> None:
    """``--faults``: per trial, claim one row of this worker's share (id % of = k), print
    "claimed", and wait for a line inside the row's ``async with`` (the parent freezes
    this process meanwhile); then complete it and print what happened."""
    lines, incoming = anyio.create_memory_object_stream[str](trials)

    async def read_stdin() -> None:
        async with lines:
            for _ in range(trials):
                await lines.send(await anyio.to_thread.run_sync(sys.stdin.readline))

    async with asynclock.connect(url) as backend, anyio.create_task_group() as tg:
        tg.start_soon(read_stdin)
        claims = backend.claims(table, ttl=FAULT_TTL, where=f"id % {of} = {k}")
        for _ in range(trials):
            async with claims.take() as batch:
                (job,) = batch
                emit("claimed", id=job.id, token=job.token)
                go = False
                try:
                    async with job:
                        await incoming.receive()
                        go = True
                        await job.complete(result='"late"')
                        result = "accepted"
                except asynclock.LeaseLost:
                    result = "lost"  # cancelled by the loss before it could complete
                except asynclock.StaleToken:
                    result = "refused"
                except asynclock.BackendUnavailable:
                    result = "unavailable"
            if not go:
                await incoming.receive()  # the parent's line, not read inside
            emit("finished", result=result)


async def worker(cfg: dict[str, Any]) -> None:
    if cfg["kind"] == "frozen":
        await frozen_trials(cfg["url"], cfg["table"], cfg["trials"], cfg["k"], cfg["of"])
        return
    kinds: dict[str, Callable[[str, str, int, Waits], Awaitable[list[int]]]] = {
        "hand-written": hand_written,
        "guarantee-floor": guarantee_floor,
        "asynclock": with_claims,
        "asynclock-later": functools.partial(with_claims, later=True),
        "pgqueuer": with_pgqueuer,
    }
    run = kinds[cfg["kind"]]
    waits = Waits()
    ids = await run(cfg["url"], cfg["table"], cfg["limit"], waits)
    emit("done", ids=ids, wait=waits.total, longest=waits.longest)
