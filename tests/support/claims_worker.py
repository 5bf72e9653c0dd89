"""A claims worker in its own process, driven by tests/backends/test_postgres_claims.py (and
benchmarks/bench_claims.py) through argv (JSON) and stdin/stdout (JSON lines, ``emit``).

Modes:
  drain - take up to ``limit`` rows at a time and complete each (``result`` = this
          worker's pid) until a take finds nothing and no row of the table is left
          unfinished. Prints {"event": "done", "completed": [ids], "stale": n, ...}
          (options ``probe``, ``gate``, ``ride``: see :func:`drain`).
  hold  - take up to ``limit`` rows, print {"event": "claimed", "ids": [...], "tokens":
          [...]}, then wait for a line on stdin (the test may SIGSTOP or SIGKILL it
          meanwhile); then complete each and print {"event": "finished", "results":
          ["done" | "stale:<current token>" | "unavailable" ...]}. With ``inside``: one row, and the
          wait runs inside ``async with claim:`` (a loss cancels it: "lost:<reason>").
  enter - take one row, print {"event": "claimed", ...}, wait for a line on stdin (the test
          may SIGSTOP it meanwhile, past the ttl), then enter ``async with claim:`` whose
          body's first await is an INSERT into table ``effects`` (a side effect the claim
          does not fence) and then completes; prints {"event": "finished", "results":
          ["done" | "lost:<reason>" | "stale:<token>"]}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]

import asynclock
from asynclock._harness import die_with_parent, emit

#: What a worker riding a server outage meets: the backend's error, or the driver's (its own
#: probe connection).
OUTAGE = (
    asynclock.BackendUnavailable,
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # shutting down, starting up
    asyncpg.InterfaceError,
)

#: Rows a take could have had: claimable and not locked by another worker's claim right now.
#: With ``FOR UPDATE SKIP LOCKED`` it locks them only for its own (autocommit) statement.
PROBE = """SELECT count(*) FROM (SELECT 1 FROM {t}
    WHERE (status = 'ready' AND run_after <= clock_timestamp())
       OR (status = 'claimed' AND claim_expires < clock_timestamp())
    FOR UPDATE SKIP LOCKED) AS free"""


class Probe:
    """A plain connection of the worker's own (reconnected after an outage)."""

    def __init__(self, url: str) -> None:
        self.url = url.split("?")[0]
        self.conn: Any = None

    async def fetchval(self, sql: str) -> Any:
        if self.conn is None or self.conn.is_closed():
            self.conn = await asyncpg.connect(self.url)
        return await self.conn.fetchval(sql)

    async def close(self) -> None:
        if self.conn is not None and not self.conn.is_closed():
            await self.conn.close()


async def drain(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    """Options: ``probe`` - after every empty take, count the rows it could have had (the
    idle check: a worker comes back empty-handed only when no row is free; rows here
    never return to 'ready', so a free row then was free at the take); ``gate`` - after
    completing that many rows, inside the batch, print {"event": "gated"} and wait for a
    line on stdin; ``ride`` - outlive a server outage: errors of takes and completions
    are counted and the loop goes on (a completion without an answer is "uncertain")."""
    table = cfg["table"]
    claims = backend.claims(table, ttl=cfg.get("ttl", 10.0))
    completed: list[int] = []
    uncertain: list[int] = []
    stale = lost = outages = empty = missed = 0
    gate = cfg.get("gate")
    ride = cfg.get("ride", False)
    probe = Probe(cfg["url"])
    try:
        while True:
            try:
                async with claims.take(limit=cfg.get("limit", 50)) as batch:
                    for item in batch:
                        if gate is not None and len(completed) == gate:
                            gate = None
                            emit("gated", completed=len(completed))
                            await anyio.to_thread.run_sync(sys.stdin.readline)
                        try:
                            async with item:
                                await item.complete(result=json.dumps(os.getpid()))
                        except asynclock.StaleToken:
                            stale += 1
                        except asynclock.LeaseLost:
                            lost += 1  # renewals failed past its deadline: reclaimed later
                        except asynclock.BackendUnavailable:
                            if not ride:
                                raise
                            uncertain.append(item.id)  # landed or not: the table says
                        else:
                            completed.append(item.id)
                    got = len(batch)
                if got:
                    continue
                empty += 1
                if cfg.get("probe"):
                    missed += await probe.fetchval(PROBE.format(t=table))
                left = await probe.fetchval(f"SELECT count(*) FROM {table} WHERE status <> 'done'")
            except OUTAGE:
                if not ride:
                    raise
                outages += 1
                await anyio.sleep(0.05)  # the server is restarting: try again soon
                continue
            if left == 0:
                break
            await anyio.sleep(0.02)  # rows still claimed by others: look again soon
    finally:
        await probe.close()
    emit(
        "done",
        completed=completed,
        uncertain=uncertain,
        stale=stale,
        lost=lost,
        outages=outages,
        empty=empty,
        missed=missed,
    )


async def hold(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    claims = backend.claims(cfg["table"], ttl=cfg.get("ttl", 10.0))
    results: list[str] = []
    async with claims.take(limit=cfg.get("limit", 1)) as batch:
        items = list(batch)
        emit("claimed", ids=[c.id for c in items], tokens=[c.token for c in items])
        if cfg.get("inside"):
            # Frozen inside the row's work: a lost claim cancels the wait for stdin.
            (item,) = items
            try:
                async with item:
                    await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                    await item.complete(result=json.dumps(os.getpid()))
                    results.append("done")
            except asynclock.LeaseLost as exc:
                results.append(f"lost:{exc.reason}")
            except asynclock.StaleToken as exc:
                results.append(f"stale:{exc.current}")
            emit("finished", results=results)
            return
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for item in items:
            try:
                await item.complete(result=json.dumps(os.getpid()))
            except asynclock.StaleToken as exc:
                results.append(f"stale:{exc.current}")
            except asynclock.BackendUnavailable:
                results.append("unavailable")  # its connection died (a server restart)
            else:
                results.append("done")
    emit("finished", results=results)


async def enter(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    claims = backend.claims(cfg["table"], ttl=cfg.get("ttl", 10.0))
    effects = await asyncpg.connect(cfg["url"].split("?")[0])
    results: list[str] = []
    try:
        async with claims.take() as batch:
            (item,) = batch
            emit("claimed", ids=[item.id], tokens=[item.token])
            await anyio.to_thread.run_sync(sys.stdin.readline)
            try:
                async with item:
                    # The body's first await, a simple query: asyncpg writes it to the
                    # socket before it first suspends, so a cancellation cannot stop it.
                    await effects.execute(
                        f"INSERT INTO {cfg['effects']} (row_id, pid) "
                        f"VALUES ({int(item.id)}, {os.getpid()})"
                    )
                    await item.complete(result=json.dumps(os.getpid()))
                    results.append("done")
            except asynclock.LeaseLost as exc:
                results.append(f"lost:{exc.reason}")
            except asynclock.StaleToken as exc:
                results.append(f"stale:{exc.current}")
    finally:
        await effects.close()
    emit("finished", results=results)


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent(cfg["parent"])
    async with asynclock.connect(cfg["url"]) as backend:
        if cfg["mode"] == "drain":
            await drain(backend, cfg)
        elif cfg["mode"] == "hold":
            await hold(backend, cfg)
        elif cfg["mode"] == "enter":
            await enter(backend, cfg)
        else:
            raise SystemExit(f"unknown mode {cfg['mode']!r}")


if __name__ == "__main__":
    anyio.run(main)
