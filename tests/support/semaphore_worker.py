"""A semaphore holder in its own process, for tests/backends/test_semaphore_faults.py.

``python -m tests.support.semaphore_worker CONFIG_JSON`` (started through asynclock's
process harness: :func:`asynclock._harness.spawn`). Until told ``stop`` it loops: take a
permit of ``name`` (``limit``, ``ttl``) → write ``enter`` to the fenced probe of the
permit's slot with its token → a little work → write ``exit`` with the same token → give
the permit back. Every step is an event (:func:`asynclock._harness.emit`, stamped with
``time.monotonic()``, system-wide on Linux).

The probe (:class:`Probe`) keeps, per slot, the last token it accepted, and a log of what
it accepted in its own order. ``enter`` is a compare-and-set "token > last", ``exit``
"token == last" (the same holder, still the newest): a holder frozen past its ttl whose
slot was granted again is refused. It lives in the store under test: a Redis hash and list
(one Lua script), a PostgreSQL row per slot and a log table (one statement), an SQLite
file (one ``BEGIN IMMEDIATE`` transaction).

Lines the parent sends on stdin:

* ``freeze`` — on the next hold, after ``enter`` was accepted, report ``freeze_me`` and
  wait (the parent SIGSTOPs it there, past its ttl); the ``exit`` write is then "on its
  way": when the permit turns out lost it is still sent (``late_write``), the write the
  fence must refuse once the slot was granted again;
* ``park`` — on the next hold, after ``enter``, report ``parked`` and hold the permit until
  killed (the parent SIGKILLs it: apscheduler#1110's spot-instance kill);
* ``stop`` — finish the current cycle, report ``done`` and exit 0.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from typing import Any

import anyio
import anyio.to_thread

import asynclock
from asynclock._harness import die_with_parent, emit

REDIS_PROBE = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local token = tonumber(ARGV[2])
local ok
if ARGV[3] == 'enter' then ok = token > last else ok = token == last end
if ok then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('RPUSH', KEYS[2], ARGV[1] .. ' ' .. ARGV[3] .. ' ' .. ARGV[2] .. ' ' .. ARGV[4])
  return 1
end
return 0
"""

PG_PROBE = """
WITH u AS (
  UPDATE semprobe SET last = $3
  WHERE name = $1 AND slot = $2 AND CASE WHEN $4 = 'enter' THEN last < $3 ELSE last = $3 END
  RETURNING 1
)
INSERT INTO semprobe_log (name, slot, kind, token, worker)
SELECT $1, $2, $4, $3, $5 FROM u RETURNING id
"""


class Probe:
    """The fenced probe resource of semaphore ``name``: one fence per slot."""

    def __init__(self, store: str, name: str) -> None:
        self.store, self.name = store, name
        self.client: Any = None

    async def open(self) -> None:
        if self.store.startswith("redis"):
            import redis.asyncio

            self.client = redis.asyncio.Redis.from_url(self.store, socket_timeout=30)
            self._script = self.client.register_script(REDIS_PROBE)
        elif self.store.startswith("postgres"):
            import asyncpg  # type: ignore[import-untyped]

            self.client = await asyncpg.connect(self.store, timeout=30)

    async def setup(self, limit: int) -> None:
        """Create the probe (the parent, once)."""
        if self.store.startswith("postgres"):
            for sql in (
                "CREATE TABLE IF NOT EXISTS semprobe (name TEXT, slot INT, last BIGINT,"
                " PRIMARY KEY (name, slot))",
                "CREATE TABLE IF NOT EXISTS semprobe_log (id BIGSERIAL PRIMARY KEY, name TEXT,"
                " slot INT, kind TEXT, token BIGINT, worker TEXT)",
            ):
                await self.client.execute(sql)
            await self.client.executemany(
                "INSERT INTO semprobe VALUES ($1, $2, 0)", [(self.name, s) for s in range(limit)]
            )
        elif not self.store.startswith("redis"):
            conn = self._sqlite()
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("CREATE TABLE IF NOT EXISTS semprobe (slot INT PRIMARY KEY, last INT)")
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS semprobe_log (id INTEGER PRIMARY KEY,"
                    " slot INT, kind TEXT, token INT, worker TEXT)"
                )
                conn.executemany("INSERT INTO semprobe VALUES (?, 0)", [(s,) for s in range(limit)])
            finally:
                conn.close()

    def _sqlite(self) -> sqlite3.Connection:
        return sqlite3.connect(self.store, isolation_level=None, timeout=30)

    def _sqlite_write(self, slot: int, token: int, kind: str, worker: str) -> bool:
        conn = self._sqlite()
        try:
            conn.execute("BEGIN IMMEDIATE")
            (last,) = conn.execute("SELECT last FROM semprobe WHERE slot = ?", (slot,)).fetchone()
            ok = token > last if kind == "enter" else token == last
            if ok:
                conn.execute("UPDATE semprobe SET last = ? WHERE slot = ?", (token, slot))
                conn.execute(
                    "INSERT INTO semprobe_log (slot, kind, token, worker) VALUES (?, ?, ?, ?)",
                    (slot, kind, token, worker),
                )
            conn.execute("COMMIT")
            return bool(ok)
        finally:
            conn.close()

    async def write(self, slot: int, token: int, kind: str, worker: str) -> bool:
        """``kind`` ("enter"/"exit") for ``slot`` with ``token``: True if accepted."""
        if self.store.startswith("redis"):
            keys = [f"semprobe:{self.name}", f"semprobe:{self.name}:log"]
            return bool(await self._script(keys=keys, args=[slot, token, kind, worker]))
        if self.store.startswith("postgres"):
            row = await self.client.fetchval(PG_PROBE, self.name, slot, token, kind, worker)
            return row is not None
        return await anyio.to_thread.run_sync(self._sqlite_write, slot, token, kind, worker)

    async def log(self) -> list[tuple[int, str, int, str]]:
        """What the probe accepted, in its own order: (slot, kind, token, worker)."""
        if self.store.startswith("redis"):
            raw = await self.client.lrange(f"semprobe:{self.name}:log", 0, -1)
            rows = [line.decode().split() for line in raw]
            return [(int(s), k, int(t), w) for s, k, t, w in rows]
        if self.store.startswith("postgres"):
            sql = "SELECT slot, kind, token, worker FROM semprobe_log WHERE name = $1 ORDER BY id"
            return [tuple(r) for r in await self.client.fetch(sql, self.name)]
        conn = self._sqlite()
        try:
            sql = "SELECT slot, kind, token, worker FROM semprobe_log ORDER BY id"
            return [tuple(r) for r in conn.execute(sql)]
        finally:
            conn.close()

    async def aclose(self) -> None:
        if self.client is not None:
            await (self.client.aclose() if self.store.startswith("redis") else self.client.close())


class State:
    def __init__(self) -> None:
        self.stop = anyio.Event()
        self.freeze = False
        self.park = False


async def commands(state: State) -> None:
    while True:
        line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        word = line.strip()
        if word == "freeze":
            state.freeze = True
        elif word == "park":
            state.park = True
        elif word == "stop" or not line:
            state.stop.set()
            return


async def cycle(sem: asynclock.Semaphore, probe: Probe, cfg: dict[str, Any], state: State) -> None:
    me = str(cfg["worker"])
    pending: tuple[int, int] | None = None
    try:
        async with sem.acquire(ttl=cfg["ttl"], timeout=cfg.get("timeout", 30.0)) as permit:
            slot, token = permit.slot, permit.token
            emit("acquired", slot=slot, token=token)
            with anyio.CancelScope(shield=True):  # a request on the wire finishes
                accepted = await probe.write(slot, token, "enter", me)
            start = time.monotonic()
            emit("enter", slot=slot, token=token, accepted=accepted, stale=permit.remaining() == 0)
            if not accepted:
                return
            pending = (slot, token)
            if state.park:
                emit("parked", slot=slot, token=token)
                await anyio.sleep_forever()
            if state.freeze:
                state.freeze = False
                emit("freeze_me", slot=slot, token=token)
                await state.stop.wait()  # frozen here; told to stop instead, carry on
            await anyio.sleep(cfg["work"])
            end = time.monotonic()
            with anyio.CancelScope(shield=True):
                accepted = await probe.write(slot, token, "exit", me)
            pending = None
            # A refusal is only allowed to a holder already past its local deadline.
            emit(
                "exit",
                slot=slot,
                token=token,
                accepted=accepted,
                stale=permit.remaining() == 0,
                start=start,
                end=end,
            )
        emit("released", slot=slot, token=token)
    except asynclock.LeaseLost as exc:
        emit("lost", token=exc.token, reason=exc.reason)
        if pending is not None:
            slot, token = pending
            accepted = await probe.write(slot, token, "exit", me)
            emit("late_write", slot=slot, token=token, accepted=accepted)
    except asynclock.AcquireTimeout:
        emit("acquire_timeout")


async def main(cfg: dict[str, Any]) -> None:
    state = State()
    probe = Probe(cfg["probe"], cfg["name"])
    await probe.open()
    async with anyio.create_task_group() as tg:
        tg.start_soon(commands, state)
        async with asynclock.connect(cfg["url"], **cfg.get("options", {})) as backend:
            sem = backend.semaphore(cfg["name"], cfg["limit"])
            emit("ready")
            cycles = 0
            while not state.stop.is_set():
                await cycle(sem, probe, cfg, state)
                cycles += 1
        await probe.aclose()
        emit("done", cycles=cycles)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    die_with_parent(config["parent"])
    try:
        anyio.run(main, config)
    except Exception as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
