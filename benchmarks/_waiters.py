"""Many waiters on one name (issue 45 item 5), the waiters part of ``bench_scale``.

W tasks wait on one name behind a holder (all in one process, or ``procs`` processes of
W / procs tasks each); the holder releases and the name is handed from waiter to waiter,
each letting it go at once, for ``handoffs`` hand-offs (the rest are then cancelled, all
at once). Per row:

* hand-off p50 / p99 — from one holder's exit from its block to the next holder's entry
  into its own (``time.monotonic``: one clock for every process on Linux);
* server work per hand-off — Redis: commands (``INFO commandstats``, those a script runs
  counted too); ZooKeeper: packets received (``srvr``); PostgreSQL: statements sent;
  etcd: RPCs sent; SQLite: statements run (each process counts its own);
* client CPU per hand-off — every waiting process's CPU from queued to done.

A herd (a release waking every waiter) shows as work and CPU per hand-off growing with W.

A child process (``procs`` > 1) is ``python -m benchmarks._waiters URL NAME W TTL``: it
prints ``queued`` once its W tasks wait, counts its CPU and work from ``go`` (its stdin,
sent just before the release), prints ``g <entered> <exited>`` per grant, and on ``stop``
cancels the rest and prints ``done <cpu s> <work>``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import anyio
import anyio.abc
from anyio.streams.text import TextReceiveStream

import asynclock
from asynclock._core.driver import Busy

#: What each backend's work column counts (the table's header says it).
WORK = {
    "redis": "Redis commands",
    "zookeeper": "ZooKeeper packets received",
    "postgres": "PostgreSQL statements",
    "postgres-lease": "PostgreSQL statements",
    "etcd": "etcd RPCs",
    "sqlite": "SQLite statements",
    "memory": "-",
}


#: Waiters started at once (see Waiters.run).
BATCH = 500


# -- counting the work ------------------------------------------------------------------


class LocalWork:
    """Work this process sends (PostgreSQL statements, etcd RPCs, SQLite statements)."""

    def __init__(self) -> None:
        self.count = 0
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, names: tuple[str, ...]) -> None:
        """Count every call of ``owner``'s methods ``names`` (a class or an instance)."""
        for name in names:
            real = getattr(owner, name, None)
            if real is None:
                continue
            setattr(owner, name, self._counted(real))
            self._undo.append(partial(setattr, owner, name, real))

    def _counted(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        return counted

    def attach(self, kind: str, backend: asynclock.Backend) -> None:
        driver: Any = backend.driver
        if kind == "sqlite":
            driver.db.set_trace_callback(lambda _sql: self._tick())
        elif kind == "etcd":
            client = driver.client
            calls = ("range", "txn", "delete", "grant", "revoke", "time_to_live", "keep_alive")
            self.wrap(client, (*calls, "watch", "cancel_watch"))
        elif kind.startswith("postgres"):
            import asyncpg  # type: ignore[import-untyped]

            queries = ("execute", "executemany", "fetch", "fetchval", "fetchrow")
            self.wrap(asyncpg.connection.Connection, queries)

    def _tick(self) -> None:
        self.count += 1

    def close(self) -> None:
        self._tick = lambda: None  # type: ignore[method-assign]  # (a trace callback)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


async def server_work(kind: str, url: str, zk_port: int | None) -> float | None:
    """The server's own count of work (Redis, ZooKeeper), or None (counted locally)."""
    if kind == "redis":
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(url)
        try:
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
        return float(sum(v["calls"] for v in stats.values())) + 1  # (+ this INFO)
    if kind == "zookeeper" and zk_port is not None:
        from asynclock._harness.zookeeper import zookeeper_four_letter

        answer = await anyio.to_thread.run_sync(zookeeper_four_letter, zk_port, b"srvr")
        for line in answer.splitlines():
            if line.startswith("Received:"):
                return float(line.split(":")[1]) + 1  # (+ this srvr)
    return None


# -- the waiters of one process -----------------------------------------------------------


class Waiters:
    """``w`` tasks of one backend waiting on ``name``; grants as (entered, exited)."""

    def __init__(self, backend: asynclock.Backend, name: str, w: int, ttl: float) -> None:
        self.backend, self.name, self.w, self.ttl = backend, name, w, ttl
        self.grants: list[tuple[float, float]] = []
        self.queued = anyio.Event()
        self.attempts = 0
        self.on_grant: Callable[[float, float], None] = lambda entered, exited: None
        busy: set[str] = set()
        self.busy = busy
        self._more = anyio.Event()  # set at each new busy waiter
        driver: Any = backend.driver
        real: Callable[..., Awaitable[int | Busy]] = driver.acquire

        async def counted(n: str, owner: str, t: float, *, queue: bool, scope: Any = None) -> Any:
            self.attempts += 1
            result = await real(n, owner, t, queue=queue, scope=scope)
            if queue and isinstance(result, Busy) and owner not in busy:
                busy.add(owner)
                self._more.set()
                if len(busy) >= w:
                    self.queued.set()
            return result

        driver.acquire = counted

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the waiters, ``BATCH`` at a time, each batch once the last is queued (ten
        thousand first attempts at once time out against a loaded server)."""
        for start in range(0, self.w, BATCH):
            for _ in range(start, min(self.w, start + BATCH)):
                tg.start_soon(self._one)
            while len(self.busy) < min(self.w, start + BATCH):
                self._more = anyio.Event()
                await self._more.wait()

    async def settled(self) -> None:
        """Every waiter queued, and the attempts of queueing done (a first busy answer is
        often followed by a second attempt, once the waiter listens): measured from here,
        only the hand-offs' own work counts. The benchmark's pacing: a quarter second with
        at most 1 % of W attempts (a head's fallback polls go on)."""
        await self.queued.wait()
        for _ in range(120):
            before = self.attempts
            await anyio.sleep(0.25)
            if self.attempts - before <= max(5, self.w // 100):
                return

    async def _one(self) -> None:
        async with self.backend.lock(self.name, ttl=self.ttl, timeout=3600):
            entered = time.monotonic()
            exited = time.monotonic()
        self.grants.append((entered, exited))
        self.on_grant(entered, exited)


def handoff_times(released: float, grants: list[tuple[float, float]], h: int) -> list[float]:
    """Hand-off latencies of the first ``h`` grants (all processes' grants, merged)."""
    grants = sorted(grants)[:h]
    before, out = released, []
    for entered, exited in grants:
        out.append(entered - before)
        before = exited
    return out


def summary(
    w: int, procs: int, times: list[float], cpu: float, work: float | None
) -> dict[str, Any]:
    h = len(times)
    q = statistics.quantiles(times, n=100) if h > 1 else times * 99
    return {
        "w": w,
        "procs": procs,
        "handoffs": h,
        "p50_ms": 1000 * statistics.median(times) if times else float("nan"),
        "p99_ms": 1000 * q[98] if times else float("nan"),
        "work": None if work is None or not h else work / h,
        "cpu_us": 1e6 * cpu / h if h else float("nan"),
    }


async def in_one_process(
    kind: str, url: str, w: int, h: int, ttl: float, zk_port: int | None
) -> dict[str, Any]:
    """``w`` waiters in this process; ``h`` hand-offs measured, then the rest cancelled."""
    name = f"scale:one:{w}:{time.monotonic_ns()}"
    local = LocalWork()
    async with asynclock.connect(url) as backend:
        first = await backend.acquire(name, ttl=ttl)
        waiters = Waiters(backend, name, w, ttl)
        enough = anyio.Event()
        waiters.on_grant = lambda e, x: enough.set() if len(waiters.grants) >= h else None
        async with anyio.create_task_group() as tg:
            await waiters.run(tg)
            with anyio.fail_after(3600):
                await waiters.settled()
            local.attach(kind, backend)
            server0 = await server_work(kind, url, zk_port)
            cpu0, released = time.process_time(), time.monotonic()
            await first.release()
            with anyio.fail_after(3600):
                await enough.wait()
            cpu = time.process_time() - cpu0
            counted = local.count  # (not the cancellation's work below)
            server1 = await server_work(kind, url, zk_port)
            local.close()
            tg.cancel_scope.cancel()
    work = server1 - server0 if server0 is not None and server1 is not None else None
    if work is None and kind != "memory":
        work = counted
    times = handoff_times(released, waiters.grants, h)
    return summary(w, 1, times, cpu, work)


async def in_processes(
    kind: str, url: str, w: int, h: int, ttl: float, zk_port: int | None, procs: int
) -> dict[str, Any]:
    """``procs`` child processes of ``w / procs`` waiters each (see the module)."""
    name = f"scale:procs:{w}:{time.monotonic_ns()}"
    each = w // procs
    grants: list[tuple[float, float]] = []
    done: list[tuple[float, float]] = []
    queued = 0
    all_queued, enough, finished = anyio.Event(), anyio.Event(), anyio.Event()
    command = [sys.executable, "-m", "benchmarks._waiters", url, name, str(each), str(ttl)]
    async with asynclock.connect(url) as backend:
        first = await backend.acquire(name, ttl=ttl)
        # (stderr inherited: a child's traceback shows in the run's output)
        children = [await anyio.open_process(command, stderr=None) for _ in range(procs)]

        async def read(child: anyio.abc.Process) -> None:
            nonlocal queued
            assert child.stdout is not None
            buffer = ""
            said_done = False
            async for text in TextReceiveStream(child.stdout):
                buffer += text
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    word, *rest = line.split()
                    if word == "queued":
                        queued += 1
                        if queued == procs:
                            all_queued.set()
                    elif word == "g":
                        grants.append((float(rest[0]), float(rest[1])))
                        if len(grants) >= h:
                            enough.set()
                    elif word == "done":
                        said_done = True
                        done.append((float(rest[0]), float(rest[1])))
                        if len(done) == procs:
                            finished.set()
            if not said_done:  # it died: the run cannot finish (it waited an hour)
                raise RuntimeError(f"a waiting process exited early: {await child.wait()}")

        try:
            async with anyio.create_task_group() as tg:
                for child in children:
                    tg.start_soon(read, child)
                with anyio.fail_after(3600):
                    await all_queued.wait()
                for child in children:
                    assert child.stdin is not None
                    await child.stdin.send(b"go\n")
                server0 = await server_work(kind, url, zk_port)
                released = time.monotonic()
                await first.release()
                with anyio.fail_after(3600):
                    await enough.wait()
                server1 = await server_work(kind, url, zk_port)
                for child in children:
                    assert child.stdin is not None
                    await child.stdin.send(b"stop\n")
                with anyio.fail_after(600):
                    await finished.wait()
        finally:
            for child in children:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.aclose()
    cpu = sum(c for c, _ in done)
    if server0 is not None and server1 is not None:
        work: float | None = server1 - server0
    else:
        work = None if kind == "memory" else sum(n for _, n in done)
    return summary(w, procs, handoff_times(released, grants, h), cpu, work)


async def child(url: str, name: str, w: int, ttl: float) -> None:
    """One child process of :func:`in_processes`."""
    kind = url.split(":", 1)[0]
    kind = {"postgresql": "postgres"}.get(kind, kind)
    local = LocalWork()

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async with asynclock.connect(url) as backend:
        waiters = Waiters(backend, name, w, ttl)
        waiters.on_grant = lambda entered, exited: say(f"g {entered!r} {exited!r}")
        async with anyio.create_task_group() as tg:
            await waiters.run(tg)
            await waiters.settled()
            say("queued")
            stdin = anyio.wrap_file(sys.stdin)
            while (await stdin.readline()).strip() != "go":
                pass
            local.attach(kind, backend)
            cpu0 = time.process_time()
            while (await stdin.readline()).strip() != "stop":
                pass
            cpu = time.process_time() - cpu0
            counted = local.count  # (not the cancellation's work below)
            local.close()
            tg.cancel_scope.cancel()
    say(f"done {cpu!r} {counted}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        yield


if __name__ == "__main__":
    with _quiet():
        anyio.run(child, sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
