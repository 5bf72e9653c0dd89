"""Idempotency keys (issue 24, "Measured"): a redelivery storm, frozen holders, overhead.

Three tables, side by side in one run, on SQLite, PostgreSQL (session and lease mode) and
Redis, each a server this script starts (a SQLite file in a temp dir, a throwaway
PostgreSQL with fsync off, a redis-server without persistence), the peers in the same run:

A. **Duplicates.** ``--procs`` worker processes (default 4), each with its own backend,
   start ``--dups`` concurrent calls (default 250) of each of ``--keys`` keys (default 20)
   at once: ``backend.idempotent(key, ttl=10, wait=120)``, whose body sleeps
   ``--body`` seconds and returns an id of its run. Per backend: how many times each key's
   body ran (min/max over the keys; exactly once is 1/1), replays, calls whose result is
   not the one stored for their key, lock attempts that found the key busy (the workers'
   ``backend.stats().busy_attempts``), and errors.
B. **A holder frozen past its ttl.** A worker process takes a key (``ttl`` 1 s) and is
   SIGSTOPped; this process calls the same key with ``wait``: it gets the key once the
   frozen lease has expired at the server, runs the body and saves. Then the worker is
   SIGCONTed and saves its own result. ``--trials`` per backend (default 100), run by
   ``--holders`` workers at a time (default 10), each trial on its own key. Per backend:
   successor runs, stale saves rejected, overwrites (the stale save accepted, or a
   later replay that is not the successor's result), errors, and the time from SIGSTOP
   to the successor's start.
C. **Overhead**, one caller, no contention, ``--calls`` calls (default 500) per row,
   median of ``--reps`` (default 3): ``async with backend.lock(name)`` on a fresh name
   per call; an idempotent call on a fresh key (its first run: record read, lease,
   running record, result saved, release); a replay (one record read). µs per call and
   the ratio to the plain lock.

Usage (as a module, or as a script: ``python benchmarks/bench_idempotency.py``)::

    flock -x /tmp/cpu.lock uv run python -m benchmarks.bench_idempotency [--quick]
        [--backends sqlite,postgres,postgres-lease,redis] [--loop asyncio]

``--quick`` is a smoke run (small sizes). This prints tables; it is not a pass/fail test,
but it exits 1 if a body ran twice or a stale save was accepted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

import asynclock
from asynclock._harness import Worker, WorkerGroup, emit
from benchmarks import _loops as loops

SCRIPT = os.path.abspath(__file__)
BACKENDS = ("sqlite", "postgres", "postgres-lease", "redis")


# -- the worker processes -------------------------------------------------------------------


async def duplicates(cfg: dict[str, Any]) -> None:
    """Table A, one process: every key, ``dups`` calls each, all at once."""
    runs: collections.Counter[str] = collections.Counter()
    replays: collections.Counter[str] = collections.Counter()
    seen: dict[str, set[str]] = collections.defaultdict(set)
    errors: collections.Counter[str] = collections.Counter()
    samples: dict[str, str] = {}  # one message per error type

    async def call(key: str) -> None:
        try:
            async with backend.idempotent(key, ttl=10.0, wait=120.0) as op:
                if op.replayed:
                    replays[key] += 1
                    result = op.result
                else:
                    runs[key] += 1
                    await anyio.sleep(cfg["body"])  # the duplicates arrive while it runs
                    result = {"run": f"{os.getpid()}-{uuid.uuid4().hex}"}
                    await op.save(result)
            seen[key].add(result["run"])
        except Exception as exc:
            errors[type(exc).__name__] += 1
            samples.setdefault(type(exc).__name__, str(exc)[:200])

    async def progress() -> None:  # what is done so far, should the parent give up
        while True:
            await anyio.sleep(1.0)
            finished = sum(runs.values()) + sum(replays.values()) + sum(errors.values())
            emit(
                "progress",
                finished=finished,
                runs=dict(runs),
                errors=dict(errors),
                samples=samples,
                busy=backend.stats().busy_attempts,
            )

    async with asynclock.connect(cfg["url"]) as backend:
        emit("ready")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        async with anyio.create_task_group() as outer:
            outer.start_soon(progress)
            async with anyio.create_task_group() as tg:
                for _ in range(cfg["dups"]):
                    for key in cfg["keys"]:
                        tg.start_soon(call, key)
            outer.cancel_scope.cancel()
        busy = backend.stats().busy_attempts
    emit(
        "done",
        runs=dict(runs),
        replays=dict(replays),
        seen={k: sorted(v) for k, v in seen.items()},
        errors=dict(errors),
        samples=samples,
        busy=busy,
    )


async def frozen_holder(cfg: dict[str, Any]) -> None:
    """Table B, one process: for each ``hold KEY`` line, take the key and report its
    token; then, shielded (a body busy in code that cannot be cancelled, as a frozen
    process is), wait for ``save`` and save; report ``saved`` or ``stale``, then how the
    ``async with`` ended."""
    async with asynclock.connect(cfg["url"]) as backend:
        emit("ready")
        while line := (await anyio.to_thread.run_sync(sys.stdin.readline)).split():
            try:
                async with backend.idempotent(line[1], ttl=cfg["ttl"]) as op:
                    emit("acquired", token=op.token, replayed=op.replayed)
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(sys.stdin.readline)
                        try:
                            await op.save({"by": "frozen holder"})
                        except asynclock.StaleToken as exc:
                            emit("stale", token=exc.token)
                        else:
                            emit("saved")
            except asynclock.LeaseLost:
                emit("end", how="LeaseLost")
            except Exception as exc:
                emit("end", how=f"{type(exc).__name__}: {exc}")
            else:
                emit("end", how="exit")


async def worker(cfg: dict[str, Any]) -> None:
    await (duplicates if cfg["kind"] == "duplicates" else frozen_holder)(cfg)


def run_worker(raw: str) -> None:
    cfg = json.loads(raw)
    loops.run(cfg["loop"], worker, cfg)


# -- A. duplicates --------------------------------------------------------------------------


async def table_a(
    url: str, loop: str, procs: int, dups: int, nkeys: int, body: float, limit: float
) -> dict[str, Any]:
    """Table A on one backend; after ``limit`` seconds the workers are stopped and what
    they had done at their last report (once a second) is returned."""
    keys = [f"a:{uuid.uuid4().hex[:8]}:{i}" for i in range(nkeys)]
    async with WorkerGroup() as group:
        workers = []
        for i in range(procs):
            cfg = {"kind": "duplicates", "loop": loop, "url": url, "keys": keys, "dups": dups}
            cfg["body"] = body
            workers.append(
                await group.start([SCRIPT, "--worker", json.dumps(cfg)], label=f"A{i}", timeout=300)
            )
        for w in workers:
            await w.expect("ready")
        start = time.perf_counter()
        for w in workers:
            await w.send("go")
        last: list[dict[str, Any]] = [
            {"finished": 0, "runs": {}, "errors": {}, "busy": 0} for _ in workers
        ]
        reports: list[dict[str, Any]] = [{} for _ in workers]

        async def collect(i: int, w: Worker) -> None:
            while (event := await w.next_event(limit + 5))["event"] == "progress":
                last[i] = event
            assert event["event"] == "done", event
            reports[i] = event

        with anyio.move_on_after(limit):
            async with anyio.create_task_group() as tg:
                for i, w in enumerate(workers):
                    tg.start_soon(collect, i, w)
        elapsed = time.perf_counter() - start
    samples: dict[str, str] = {}
    if not all(reports):  # out of time: what the workers had done at their last report
        runs = {k: sum(p["runs"].get(k, 0) for p in last) for k in keys}
        so_far: collections.Counter[str] = collections.Counter()
        for p in last:
            so_far.update(p["errors"])
            samples.update(p.get("samples", {}))
        return {
            "calls": procs * dups * nkeys,
            "finished": sum(p["finished"] for p in last),
            "runs_min": min(runs.values()),
            "runs_max": max(runs.values()),
            "replays": None,
            "other_results": None,
            "errors": dict(so_far),
            "samples": samples,
            "busy": sum(p["busy"] for p in last),
            "seconds": elapsed,
        }
    runs = {k: sum(r["runs"].get(k, 0) for r in reports) for k in keys}
    seen = {k: set().union(*(r["seen"].get(k, []) for r in reports)) for k in keys}
    errors: collections.Counter[str] = collections.Counter()
    for r in reports:
        errors.update(r["errors"])
        samples.update(r["samples"])
    return {
        "calls": procs * dups * nkeys,
        "finished": procs * dups * nkeys,
        "runs_min": min(runs.values()),
        "runs_max": max(runs.values()),
        "replays": sum(sum(r["replays"].values()) for r in reports),
        # Each key's callers saw one result, the one its single run stored.
        "other_results": sum(len(v) - 1 for v in seen.values() if v),
        "errors": dict(errors),
        "samples": samples,
        "busy": sum(r["busy"] for r in reports),
        "seconds": elapsed,
    }


# -- B. a holder frozen past its ttl --------------------------------------------------------


async def one_trial(backend: asynclock.Backend, holder: Worker, stats: dict[str, Any]) -> None:
    key = f"b:{uuid.uuid4().hex}"
    await holder.send(f"hold {key}")
    first = await holder.expect("acquired")
    holder.pause()
    await holder.wait_stopped(10)
    stopped = time.monotonic()
    try:
        async with backend.idempotent(key, ttl=10.0, wait=30.0) as op:
            if op.replayed:
                stats["replayed"] += 1  # the frozen holder's result: must not happen
            else:
                stats["takeover"].append(time.monotonic() - stopped)
                stats["runs"] += 1
                if op.token <= first["token"]:
                    stats["token_not_larger"] += 1
                await op.save({"by": "successor"})
    finally:
        holder.resume()
    await holder.send("save")
    late = await holder.next_event(what="the late save")
    if late["event"] == "stale":
        stats["stale"] += 1
    else:
        stats["overwrites"] += 1
    end = await holder.expect("end")
    if end["how"] != "LeaseLost":
        stats["errors"][f"holder ended: {end['how']}"] += 1
    async with backend.idempotent(key, ttl=10.0) as again:
        if not (again.replayed and again.result == {"by": "successor"}):
            stats["overwrites"] += 1


async def table_b(url: str, loop: str, trials: int, holders: int, ttl: float) -> dict[str, Any]:
    stats: dict[str, Any] = {
        "trials": 0,
        "runs": 0,
        "stale": 0,
        "overwrites": 0,
        "replayed": 0,
        "token_not_larger": 0,
        "takeover": [],
        "errors": collections.Counter(),
    }
    async with WorkerGroup() as group, asynclock.connect(url) as backend:
        workers = []
        for i in range(min(holders, trials)):
            cfg = {"kind": "frozen", "loop": loop, "url": url, "ttl": ttl}
            workers.append(
                await group.start([SCRIPT, "--worker", json.dumps(cfg)], label=f"B{i}", timeout=60)
            )
        for w in workers:
            await w.expect("ready")

        async def run(w: Worker, n: int) -> None:
            for _ in range(n):
                try:
                    await one_trial(backend, w, stats)
                except Exception as exc:
                    stats["errors"][f"{type(exc).__name__}: {exc}"[:120]] += 1
                    return  # this holder's state is unknown: it runs no more trials
                stats["trials"] += 1

        async with anyio.create_task_group() as tg:
            for i, w in enumerate(workers):
                tg.start_soon(run, w, trials // len(workers) + (i < trials % len(workers)))
    return stats


# -- C. overhead ----------------------------------------------------------------------------


async def table_c(url: str, calls: int, reps: int) -> dict[str, float]:
    async def ok() -> str:
        return "ok"

    async with asynclock.connect(url) as backend:
        run = uuid.uuid4().hex[:8]
        stored = f"c:{run}:stored"
        await backend.idempotent(stored, ttl=10.0).run(ok)
        samples: dict[str, list[float]] = {"lock": [], "first": [], "replay": []}
        for rep in range(reps):
            start = time.perf_counter()
            for i in range(calls):
                async with backend.lock(f"c:{run}:lock:{rep}:{i}", ttl=10.0):
                    pass
            samples["lock"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for i in range(calls):
                async with backend.idempotent(f"c:{run}:{rep}:{i}", ttl=10.0) as op:
                    await op.save("ok")
            samples["first"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(calls):
                async with backend.idempotent(stored, ttl=10.0) as op:
                    assert op.replayed
            samples["replay"].append(time.perf_counter() - start)
    return {k: statistics.median(v) / calls * 1e6 for k, v in samples.items()}


# -- the parent -----------------------------------------------------------------------------


@contextlib.contextmanager
def servers(wanted: list[str]) -> Iterator[dict[str, str]]:
    """The URL of each wanted backend, on servers started here (stopped on exit)."""
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-idem-")))
        urls: dict[str, str] = {}
        if "sqlite" in wanted:
            urls["sqlite"] = f"sqlite:///{tmp / 'locks.db'}"
        if "postgres" in wanted or "postgres-lease" in wanted:
            from asynclock._harness.pg_server import running_pg

            pg = stack.enter_context(running_pg("bench-idem-pg-"))
            urls["postgres"] = pg.url()
            urls["postgres-lease"] = pg.url() + "?mode=lease"
        if "redis" in wanted:
            from asynclock._harness.servers import RedisServer

            server = RedisServer(tmp / "redis").start()
            stack.callback(server.stop)
            urls["redis"] = server.url
        yield {name: urls[name] for name in wanted}


def fmt_errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())) or "0"


async def bench(urls: dict[str, str], loop: str, args: argparse.Namespace) -> bool:
    good = True
    if "a" in args.tables:
        print(
            f"\nA. {args.procs} processes x {args.dups} concurrent duplicates of each of "
            f"{args.keys} keys (body {args.body:g} s, wait=120; stopped after "
            f"{args.a_limit:g} s)"
        )
        print(
            f"{'backend':<15} {'calls':>6} {'runs/key':>9} {'replays':>8} "
            f"{'other result':>13} {'seconds':>8} {'busy tries':>11}  errors",
            flush=True,
        )
        for name, url in urls.items():
            r = await table_a(url, loop, args.procs, args.dups, args.keys, args.body, args.a_limit)
            runs = f"{r['runs_min']}..{r['runs_max']}"
            if r["runs_min"] == r["runs_max"]:
                runs = str(r["runs_min"])
            if r["replays"] is None:
                print(
                    f"{name:<15} {r['calls']:>6} {runs:>9}  not finished: "
                    f"{r['finished']} calls done in {r['seconds']:.0f} s; {r['busy']} busy "
                    f"tries; errors {fmt_errors(r['errors'])}",
                    flush=True,
                )
            else:
                print(
                    f"{name:<15} {r['calls']:>6} {runs:>9} {r['replays']:>8} "
                    f"{r['other_results']:>13} {r['seconds']:>8.1f} {r['busy']:>11}  "
                    f"{fmt_errors(r['errors'])}",
                    flush=True,
                )
            for kind, message in sorted(r["samples"].items()):
                print(f"{'':<15} e.g. {kind}: {message}", flush=True)
            good &= r["runs_max"] <= 1 and not r["other_results"]

    if "b" in args.tables:
        print(
            f"\nB. a holder SIGSTOPped past its ttl ({args.ttl:g} s), {args.trials} trials "
            f"per backend, {args.holders} at a time"
        )
        print(
            f"{'backend':<15} {'trials':>6} {'successor runs':>15} {'stale rejected':>15} "
            f"{'overwrites':>11} {'takeover p50/max s':>19}  errors",
            flush=True,
        )
        for name, url in urls.items():
            st = await table_b(url, loop, args.trials, args.holders, args.ttl)
            t = st["takeover"]
            takeover = f"{statistics.median(t):.2f}/{max(t):.2f}" if t else "-"
            extra = dict(st["errors"])
            if st["replayed"]:
                extra["successor replayed the frozen result"] = st["replayed"]
            if st["token_not_larger"]:
                extra["successor token not larger"] = st["token_not_larger"]
            print(
                f"{name:<15} {st['trials']:>6} {st['runs']:>15} {st['stale']:>15} "
                f"{st['overwrites']:>7} / {st['trials']:<3} {takeover:>19}  "
                f"{fmt_errors(extra)}",
                flush=True,
            )
            good &= st["overwrites"] == 0 and st["replayed"] == 0

    if "c" in args.tables:
        print(
            f"\nC. overhead, one caller, {args.calls} calls per row, median of {args.reps} "
            "(µs per call)"
        )
        print(
            f"{'backend':<15} {'plain lock':>11} {'idempotent first run':>21} {'x lock':>6} "
            f"{'replay':>8} {'x lock':>6}",
            flush=True,
        )
        for name, url in urls.items():
            c = await table_c(url, args.calls, args.reps)
            print(
                f"{name:<15} {c['lock']:>11.0f} {c['first']:>21.0f} "
                f"{c['first'] / c['lock']:>6.2f} {c['replay']:>8.0f} "
                f"{c['replay'] / c['lock']:>6.2f}",
                flush=True,
            )
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--procs", type=int, help="A: worker processes (default 4)")
    parser.add_argument("--dups", type=int, help="A: duplicates per key per process (250)")
    parser.add_argument("--keys", type=int, help="A: keys (20)")
    parser.add_argument("--body", type=float, default=0.2, help="A: body seconds (0.2)")
    parser.add_argument("--trials", type=int, help="B: trials per backend (100)")
    parser.add_argument("--holders", type=int, help="B: frozen holders at a time (10)")
    parser.add_argument("--calls", type=int, help="C: calls per row (500)")
    parser.add_argument("--reps", type=int, help="C: repetitions (3)")
    parser.add_argument("--a-limit", type=float, default=120.0, help="A: seconds per backend")
    parser.add_argument("--ttl", type=float, help="B: the frozen holder's ttl (1.0)")
    parser.add_argument("--tables", default="abc", help="which tables: a, b, c (default abc)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    loops.add_option(parser)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker)
        return
    sizes = (
        dict(procs=2, dups=10, keys=3, trials=2, holders=2, calls=20, reps=1, ttl=0.5)
        if args.quick
        else dict(procs=4, dups=250, keys=20, trials=100, holders=10, calls=500, reps=3, ttl=1.0)
    )
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.body = min(args.body, 0.05)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(wanted) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    print(
        f"Python {platform.python_version()}, {platform.machine()}, "
        f"asynclock {asynclock.__version__}"
    )
    good = True
    with servers(wanted) as urls:
        for loop in loops.chosen(args):
            loops.heading(loop)
            good &= loops.run(loop, bench, urls, loop, args)
    if not good:
        print("\nFAILED: a body ran twice, a caller got another result, or a stale save landed")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
