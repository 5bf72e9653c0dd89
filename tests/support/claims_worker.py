"""A claims worker in its own process, driven by tests/backends/test_postgres_claims.py (and
benchmarks/bench_claims.py) through argv (JSON) and stdin/stdout (JSON lines, ``emit``).

Modes:
  drain - take up to ``limit`` rows at a time and complete each (``result`` = this
          worker's pid) until a take finds nothing and no row of the table is left
          unfinished. Prints {"event": "done", "completed": [ids], "stale": n}.
  hold  - take up to ``limit`` rows, print {"event": "claimed", "ids": [...], "tokens":
          [...]}, then wait for a line on stdin (the test may SIGSTOP or SIGKILL it
          meanwhile); then complete each and print {"event": "finished", "results":
          ["done" | "stale:<current token>" ...]}. With ``inside``: one row, and the
          wait runs inside ``async with claim:`` (a loss cancels it: "lost:<reason>").
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


async def drain(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    claims = backend.claims(cfg["table"], ttl=cfg.get("ttl", 10.0))
    completed: list[int] = []
    stale = 0
    conn = await asyncpg.connect(cfg["url"].split("?")[0])
    try:
        while True:
            async with claims.take(limit=cfg.get("limit", 50)) as batch:
                for item in batch:
                    async with item:
                        try:
                            await item.complete(result=json.dumps(os.getpid()))
                        except asynclock.StaleToken:
                            stale += 1
                        else:
                            completed.append(item.id)
                empty = not batch
            if empty:
                left = await conn.fetchval(
                    f"SELECT count(*) FROM {cfg['table']} WHERE status <> 'done'"
                )
                if left == 0:
                    break
                await anyio.sleep(0.02)  # rows still claimed by others: look again soon
    finally:
        await conn.close()
    emit("done", completed=completed, stale=stale)


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
            else:
                results.append("done")
    emit("finished", results=results)


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    die_with_parent(cfg["parent"])
    async with asynclock.connect(cfg["url"]) as backend:
        if cfg["mode"] == "drain":
            await drain(backend, cfg)
        elif cfg["mode"] == "hold":
            await hold(backend, cfg)
        else:
            raise SystemExit(f"unknown mode {cfg['mode']!r}")


if __name__ == "__main__":
    anyio.run(main)
