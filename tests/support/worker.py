"""A lock client in its own process, driven by tests through argv (JSON) and stdin/stdout.

Events are JSON lines (``asynclock._harness.emit``: each also carries its time ``t``).

Modes:
  count  - ``rounds`` times: under the lock, read an int from ``counter_file``, yield,
           write it back + 1. Prints {"event": "done", "holds": [...]}, the holds as
           ``asynclock._harness.Hold`` records for the history checker.
  hold   - acquire ``name``, print {"event": "acquired", "token": N}, then wait until the
           lease is lost. On LeaseLost print {"event": "lost", "reason": ...}; then replay
           the write that was in flight when it froze through the SQL fence in
           ``fence_db`` and print {"event": "late_write", "result": "stale"|"accepted"}.
  lead   - like hold, through ``backend.leadership(name, identity=...)``: prints
           {"event": "acquired", ...} once elected, then the same events as hold.
  idem   - enter ``backend.idempotent(key, ttl=...)``, print {"event": "acquired", "token":
           N}, then, shielded from the lease's loss (a body busy in code that cannot be
           cancelled; ``"shield": false``: not), wait for a line on stdin and
           ``op.save(result)``; print {"event": "saved"} or {"event": "stale"} (StaleToken);
           on LeaseLost print {"event": "lost"}. ``"report_loss": true``: also print
           {"event": "lease_lost"} as soon as the lease is lost.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from typing import Any

import anyio
import anyio.to_thread

import asynclock
from asynclock._harness import Hold, emit
from asynclock.fence import SQLFence


async def count(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    path = anyio.Path(cfg["counter_file"])
    holds: list[dict[str, Any]] = []
    for _ in range(cfg["rounds"]):
        async with backend.lock(cfg["name"], ttl=cfg.get("ttl", 5.0)) as lease:
            start = time.monotonic()
            # Read-modify-write with awaits in between: any overlap loses an update.
            value = int(await path.read_text() or 0)
            await path.write_text(str(value + 1))
            hold = Hold(str(os.getpid()), start, time.monotonic(), lease.token, cfg["name"])
        holds.append(hold.to_json())
    emit("done", holds=holds)


def fenced_write(fence_db: str, key: str, token: int, value: str) -> str:
    conn = sqlite3.connect(fence_db, isolation_level=None, timeout=10)
    try:
        fence = SQLFence()
        fence.create_sqlite(conn)
        conn.execute("CREATE TABLE IF NOT EXISTS ledger (writer TEXT, token INTEGER)")
        try:
            with fence.sqlite_transaction(conn, key, token):
                conn.execute("INSERT INTO ledger VALUES (?, ?)", (value, token))
        except asynclock.StaleToken:
            return "stale"
        return "accepted"
    finally:
        conn.close()


async def hold(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    token = 0
    try:
        guard = (
            backend.leadership(cfg["name"], ttl=cfg["ttl"], identity=cfg.get("identity"))
            if cfg["mode"] == "lead"
            else backend.lock(cfg["name"], ttl=cfg["ttl"], token_scope=cfg.get("token_scope"))
        )
        async with guard as held:
            token = held.token
            if cfg.get("fence_db"):
                fenced_write(cfg["fence_db"], cfg["name"], token, "holder-before-pause")
            emit("acquired", token=token, pid_time=time.monotonic())
            await anyio.sleep_forever()
    except asynclock.LeaseLost as exc:
        emit("lost", reason=exc.reason, token=exc.token, at=time.monotonic())
        if cfg.get("fence_db"):
            result = fenced_write(cfg["fence_db"], cfg["name"], token, "holder-after-pause")
            emit("late_write", result=result)


async def idem(backend: asynclock.Backend, cfg: dict[str, Any]) -> None:
    async with anyio.create_task_group() as tg:  # outside the key's scope: never cancelled
        try:
            async with backend.idempotent(cfg["key"], ttl=cfg["ttl"]) as op:
                emit("acquired", token=op.token, replayed=op.replayed)
                if cfg.get("report_loss") and op.lease is not None:
                    tg.start_soon(report_loss, op.lease)
                with anyio.CancelScope(shield=cfg.get("shield", True)):
                    await anyio.to_thread.run_sync(sys.stdin.readline)
                    try:
                        await op.save(cfg["result"])
                    except asynclock.StaleToken as exc:
                        emit("stale", token=exc.token)
                    else:
                        emit("saved")
        except asynclock.LeaseLost as exc:
            emit("lost", reason=exc.reason, token=exc.token)
        tg.cancel_scope.cancel()


async def report_loss(lease: asynclock.Lease) -> None:
    emit("lease_lost", reason=await lease.lost.wait())


async def main() -> None:
    cfg = json.loads(sys.argv[1])
    async with asynclock.connect(cfg["url"], **cfg.get("options", {})) as backend:
        if cfg["mode"] == "count":
            await count(backend, cfg)
        elif cfg["mode"] in ("hold", "lead"):
            await hold(backend, cfg)
        elif cfg["mode"] == "idem":
            await idem(backend, cfg)
        else:
            raise SystemExit(f"unknown mode {cfg['mode']!r}")


if __name__ == "__main__":
    # "loop": "uvloop" runs the worker on uvloop (tests/test_uvloop.py), else plain asyncio.
    uvloop = json.loads(sys.argv[1]).get("loop") == "uvloop"
    anyio.run(main, backend_options={"use_uvloop": True} if uvloop else None)
