"""A partition and pause drill against a real lock deployment, with a checked history.

:func:`run` starts worker processes that loop *acquire → read a shared register → a little
work → write register + 1 through the fence with the lease's token → release*, injects
faults while they run, and checks the recorded history when they stop::

    import asynclock.drill

    report = asynclock.drill.run(spawn="redis", workers=4, duration=10)
    assert report.ok, report.problems        # 0 lost updates, tokens in order

Faults (loopback only): ``pause`` (SIGSTOP a holder past its TTL with its write on the
way, SIGCONT it once a successor has written), ``partition`` (a TCP proxy between each
worker and the lock servers, switched to blackhole or added latency for one worker),
``kill`` (kill -9 a holder and start a new worker in its lane; with ``spawn="redlock"``
every other kill is a lock node's), ``clock`` (one worker's clock runs fast or slow, through
the injectable :class:`~asynclock.Clock`).

The register is a real store: a SQLite row (``sqlite``), a Redis key (``redis``,
``redlock``: on the first node) or a PostgreSQL row (``postgresql``). With ``fence=False``
the same schedule runs unfenced, and the report shows the updates that were lost.

``asynclock drill`` is the same run from the command line; it prints a summary table and
writes ``history.jsonl``, ``report.json`` and one self-contained ``report.html`` (an SVG
timeline: a lane per worker, lease bars, fault markers, rejected writes in red).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import random
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

from ._harness import Hold, Worker, WorkerFailed, WorkerGroup, tokens_out_of_order, write_jsonl
from ._harness.history import Write, overlaps
from ._harness.proxy import Proxy
from ._harness.register import open_register
from ._harness.servers import RedisServer, running_pg

__all__ = ("FAULTS", "SPAWN", "DrillReport", "Fault", "check_url", "run", "run_async", "save")

#: Every fault the drill knows, in the order a schedule cycles through them.
FAULTS = ("pause", "partition", "kill", "clock")
#: What ``spawn=`` can start.
SPAWN = ("sqlite", "redis", "redlock", "postgres")
#: Bound on a worker's start (Python, imports, connect).
START_TIMEOUT = 30.0
#: Progress callback: (seconds elapsed, seconds planned, counters so far).
Progress = Callable[[float, float, dict[str, int]], None]


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, on whom, from ``start`` to ``end`` (monotonic seconds)."""

    kind: str
    target: str
    start: float
    end: float
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "fault",
            "fault": self.kind,
            "target": self.target,
            "start": self.start,
            "end": self.end,
            "detail": self.detail,
        }


@dataclass
class DrillReport:
    """What a drill did and whether anything was lost. ``ok``: the verdict."""

    backend: str
    url: str
    fence: bool
    workers: int
    duration: float
    ttl: float
    start: float = 0.0
    end: float = 0.0
    holds: list[Hold] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    #: The value each write carried (same order as ``writes``).
    values: list[int] = field(default_factory=list)
    #: Whether each write was a late one (sent after its lease was lost).
    late: list[bool] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: Faults asked for but not applicable here (e.g. partition on SQLite: no TCP).
    skipped: list[str] = field(default_factory=list)
    final: int = 0
    #: Writes the store itself logged as accepted (the truth when a worker died mid-write).
    applied: int = 0
    lost_leases: int = 0
    backend_errors: int = 0
    read_rejections: int = 0
    problems: list[str] = field(default_factory=list)
    report_dir: Path | None = None

    @property
    def acquisitions(self) -> int:
        return len(self.holds)

    @property
    def accepted(self) -> int:
        return sum(w.accepted for w in self.writes)

    @property
    def rejected(self) -> int:
        """Writes the fence turned away (stale tokens): each one an update saved."""
        return sum(not w.accepted for w in self.writes)

    @property
    def lost_updates(self) -> int:
        """Accepted increments the register does not show."""
        return max(0, max(self.applied, self.accepted) - self.final)

    @property
    def overlaps(self) -> int:
        """Times two workers *believed* they held the lock at once (harmless with the fence)."""
        return len(overlaps(self.holds))

    @property
    def ok(self) -> bool:
        """Fencing on, nothing lost, tokens in order: the only passing verdict."""
        return self.fence and not self.problems

    def counters(self) -> dict[str, int]:
        return {
            "faults injected": len(self.faults),
            "acquisitions": self.acquisitions,
            "leases lost": self.lost_leases,
            "believed overlaps": self.overlaps,
            "writes accepted": max(self.applied, self.accepted),
            "stale writes rejected": self.rejected,
            "register (final)": self.final,
            "lost updates": self.lost_updates,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "url": self.url,
            "fence": self.fence,
            "workers": self.workers,
            "duration": self.duration,
            "ttl": self.ttl,
            "start": self.start,
            "end": self.end,
            "ok": self.ok,
            "counters": self.counters(),
            "problems": self.problems,
            "skipped": self.skipped,
            "faults": [f.to_json() for f in self.faults],
        }


# -- URLs ----------------------------------------------------------------------------------

_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "redlock": 6379,
    "postgresql": 5432,
    "postgres": 5432,
    "etcd": 2379,
}


def _split(url: str) -> tuple[str, str, list[tuple[str, int]], str]:
    """(scheme, auth@ or "", [(host, port)...], rest) of a network URL."""
    scheme, _sep, tail = url.partition("://")
    netloc, slash, rest = tail.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = (
            item.rpartition(":") if "]" not in item.rsplit(":", 1)[-1] else ("", "", "")
        )
        if not colon:
            host, port = item, ""
        endpoints.append(
            (host.strip("[]") or "127.0.0.1", int(port) if port else _DEFAULT_PORTS.get(scheme, 0))
        )
    return scheme, auth + at, endpoints, slash + rest


def _join(scheme: str, auth: str, endpoints: Iterable[tuple[str, int]], rest: str) -> str:
    return f"{scheme}://{auth}" + ",".join(f"{h}:{p}" for h, p in endpoints) + rest


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, faults: Sequence[str], allow_remote_faults: bool) -> str:
    """The backend kind of ``url``; ValueError if faults would reach a non-loopback host."""
    scheme = urlsplit(url).scheme.lower()
    kinds = {
        "sqlite": "sqlite",
        "redis": "redis",
        "rediss": "redis",
        "redlock": "redlock",
        "postgresql": "postgres",
        "postgres": "postgres",
    }
    if scheme in ("memory", ""):
        raise ValueError(
            f"url: the drill's workers are separate processes, so they need a shared backend "
            f"(sqlite:///path, redis://, redlock://h1,h2,h3, postgresql://...), got {url!r}"
        )
    # Any other backend (etcd://...) works too: its register is then a local SQLite file.
    kind = kinds.get(scheme, scheme)
    if kind != "sqlite" and faults and not allow_remote_faults:
        remote = [h for _, _, eps, _ in [_split(url)] for h, _ in eps if not _is_loopback(h)]
        if remote:
            raise ValueError(
                f"url: {', '.join(remote)} is not a loopback address; the drill injects faults "
                "(pauses, partitions, kills) only against servers on this machine unless "
                "allow_remote_faults=True (--allow-remote-faults). Use faults=() for a "
                "fault-free run."
            )
    return kind


def _check(workers: int, duration: float, ttl: float, faults: Sequence[str]) -> None:
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 256:
        raise ValueError(f"workers must be an int from 1 to 256, got {workers!r}")
    for label, value, low in (("duration", duration, 0.5), ("ttl", ttl, 0.05)):
        if not isinstance(value, (int, float)) or not (low <= value <= 86400):
            raise ValueError(
                f"{label} must be a number of seconds from {low} to 86400, got {value!r}"
            )
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; allowed: {', '.join(FAULTS)}")


# -- the recorder --------------------------------------------------------------------------


class Recorder:
    """Builds the history from the workers' events, and lets the fault schedule wait on it."""

    def __init__(self, report: DrillReport, name: str) -> None:
        self.report = report
        self.name = name
        self.open: dict[str, tuple[int, float]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._changed = anyio.Event()

    def close_hold(self, label: str, t: float) -> None:
        if label in self.open:
            token, start = self.open.pop(label)
            self.report.holds.append(Hold(label, start, t, token, self.name))

    def feed(self, label: str, event: dict[str, Any]) -> None:
        kind, t = event.get("event"), float(event.get("t", time.monotonic()))
        if kind == "acquired":
            self.close_hold(label, t)
            self.open[label] = (int(event["token"]), t)
        elif kind in ("released", "lost"):
            self.close_hold(label, float(event.get("held_until") or t))
            self.report.lost_leases += kind == "lost"
        elif kind == "read_rejected":
            self.report.read_rejections += 1
        elif kind in ("wrote", "late_write"):
            self.report.writes.append(
                Write(label, t, int(event["token"]), bool(event["accepted"]), "register")
            )
            self.report.values.append(int(event["value"]))
            self.report.late.append(kind == "late_write")
        elif kind == "backend_error":
            self.report.backend_errors += 1
            if event.get("token") is not None:
                self.close_hold(label, t)
        self.events.append((label, event))
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, test: Callable[[str, dict[str, Any]], bool], timeout: float) -> bool:
        """True once an event (from now on) passes ``test``; False after ``timeout``."""
        seen = len(self.events)
        with anyio.move_on_after(timeout):
            while True:
                for label, event in self.events[seen:]:
                    if test(label, event):
                        return True
                seen = len(self.events)
                await self._changed.wait()
        return False


# -- servers -------------------------------------------------------------------------------


@dataclass
class Deployment:
    kind: str
    url: str
    register: str
    #: Lock servers this drill started (the kill fault may kill one; never the register's).
    servers: list[RedisServer] = field(default_factory=list)


@contextlib.contextmanager
def _spawned(kind: str, tmp: Path, run_id: str) -> Any:
    if kind == "sqlite":
        yield Deployment(
            kind, f"sqlite:///{tmp / 'locks.db'}", f"sqlite:{tmp / 'register.db'}#drill"
        )
        return
    if kind == "postgres":
        with running_pg("asynclock-drill-pg-") as pg:
            url = pg.url()
            yield Deployment(kind, url, f"{url}#drill-{run_id}")
        return
    nodes = 1 if kind == "redis" else 3
    servers = [RedisServer(tmp / f"redis{i}") for i in range(nodes)]
    try:
        for server in servers:
            server.start()
        url = (
            servers[0].url
            if kind == "redis"
            else "redlock://" + ",".join(s.address for s in servers)
        )
        yield Deployment(kind, url, f"{servers[0].url}#asynclock-drill:{run_id}", servers)
    finally:
        for server in servers:
            server.stop()


def _register_for(kind: str, url: str, tmp: Path, run_id: str) -> str:
    if kind not in ("redis", "redlock", "postgres"):
        return f"sqlite:{tmp / 'register.db'}#drill-{run_id}"
    if kind in ("redis", "redlock"):
        _scheme, auth, endpoints, rest = _split(url)
        host, port = endpoints[0]
        db = rest if kind == "redis" else ""
        return f"redis://{auth}{host}:{port}{db.partition('?')[0]}#asynclock-drill:{run_id}"
    return f"{url}#drill-{run_id}"


# -- the drill -----------------------------------------------------------------------------


@dataclass
class Slot:
    """One lane: the worker running in it now, and its proxies (one per lock server)."""

    label: str
    worker: Worker | None = None
    proxies: list[Proxy] = field(default_factory=list)
    url: str = ""
    restarts: int = 0
    paused: bool = False


class Drill:
    def __init__(
        self,
        dep: Deployment,
        report: DrillReport,
        *,
        name: str,
        workers: int,
        faults: Sequence[str],
        fence: bool,
        ttl: float,
        tmp: Path,
        progress: Progress | None,
        rng: random.Random,
        interval: float | None,
        work: float,
    ) -> None:
        self.dep, self.report, self.name = dep, report, name
        self.n, self.faults, self.fence, self.ttl, self.tmp = workers, faults, fence, ttl, tmp
        self.progress, self.rng, self.interval, self.work = progress, rng, interval, work
        self.recorder = Recorder(report, name)
        self.slots = [Slot(f"w{i + 1}") for i in range(workers)]
        self.group = WorkerGroup()
        self.killed_node: RedisServer | None = None
        self.kills = 0

    def _argv(self, slot: Slot) -> list[str]:
        argv = [
            "-m",
            "asynclock._harness.drill_worker",
            "--url",
            slot.url,
            "--register",
            self.dep.register,
            "--name",
            self.name,
            "--ttl",
            repr(self.ttl),
            "--work",
            repr(self.work),
            "--acquire-timeout",
            repr(max(5.0, 6 * self.ttl)),
            "--parent",
            str(os.getpid()),
        ]
        return argv if self.fence else [*argv, "--no-fence"]

    async def _start(self, slot: Slot, tg: anyio.abc.TaskGroup) -> None:
        stderr = self.tmp / f"{slot.label}-{slot.restarts}.stderr"
        worker = await self.group.start(
            self._argv(slot), label=slot.label, stderr=stderr, timeout=START_TIMEOUT
        )
        await worker.expect("ready", START_TIMEOUT, f"{slot.label} connecting")
        slot.worker = worker
        tg.start_soon(self._read, slot, worker)

    async def _read(self, slot: Slot, worker: Worker) -> None:
        while True:
            try:
                events = await worker.next_events(timeout=3600)
            except WorkerFailed as exc:
                if slot.worker is worker and worker.returncode not in (0, -9):
                    self.report.problems.append(f"{slot.label} failed: {exc}")
                self.recorder.close_hold(slot.label, time.monotonic())
                return
            for event in events:
                if event.get("event") == "error":
                    self.report.problems.append(f"{slot.label}: {event.get('message')}")
                self.recorder.feed(slot.label, event)
                if event.get("event") == "done":
                    return

    def _pick(self, holders_first: bool = True) -> Slot:
        live = [s for s in self.slots if s.worker is not None and not s.paused]
        holding = [s for s in live if s.label in self.recorder.open]
        return self.rng.choice(holding if holders_first and holding else live)

    def _fault(self, kind: str, target: str, start: float, detail: str) -> None:
        self.report.faults.append(Fault(kind, target, start, time.monotonic(), detail))

    # -- faults ----------------------------------------------------------------------------

    async def pause(self, tg: anyio.abc.TaskGroup) -> None:
        slot = self._pick(holders_first=False)
        worker = slot.worker
        assert worker is not None
        await worker.send("freeze")
        box: dict[str, int] = {}

        def ready(label: str, ev: dict[str, Any]) -> bool:
            if label == slot.label and ev.get("event") == "freeze_me":
                box["token"] = int(ev["token"])
                return True
            return False

        if not await self.recorder.wait_for(ready, 6 * self.ttl + 10):
            return
        slot.paused = True
        worker.pause()
        start = time.monotonic()
        await worker.wait_stopped(10)
        token = box["token"]
        # Frozen past its TTL until a successor has written (or, alone, for 3 TTLs).
        successor = lambda label, ev: (  # noqa: E731
            label != slot.label and ev.get("event") == "wrote" and int(ev["token"]) > token
        )
        timeout = 3 * self.ttl + (10 if self.n > 1 else 0)
        await self.recorder.wait_for(successor, timeout)
        worker.resume()
        slot.paused = False
        late = lambda label, ev: label == slot.label and ev.get("event") == "late_write"  # noqa: E731
        await self.recorder.wait_for(late, 10)
        self._fault("pause", slot.label, start, f"SIGSTOP with token {token}'s write on its way")

    async def kill(self, tg: anyio.abc.TaskGroup) -> None:
        self.kills += 1
        if len(self.dep.servers) > 1 and self.kills % 2 == 1:  # nodes first: short drills too
            start = time.monotonic()
            if self.killed_node is not None:
                self.killed_node.restart(keep_data=False)
            node = self.rng.choice(self.dep.servers[1:])  # the first one keeps the register
            node.kill()
            self.killed_node = node
            self._fault("kill", f"node {node.address}", start, "kill -9 a lock server")
            return
        slot = self._pick()
        worker = slot.worker
        assert worker is not None
        start = time.monotonic()
        slot.worker = None
        worker.kill()
        await worker.wait(10)
        self.recorder.close_hold(slot.label, start)
        slot.restarts += 1
        await self._start(slot, tg)
        self._fault("kill", slot.label, start, "kill -9 a worker; a new one took its lane")

    async def partition(self, tg: anyio.abc.TaskGroup) -> None:
        slot = self._pick()
        start = time.monotonic()
        if sum(f.kind == "partition" for f in self.report.faults) % 2 == 0:
            mode, delay, length = "blackhole", 0.0, 1.5 * self.ttl
        else:
            mode, delay, length = "latency", self.ttl / 4, 2 * self.ttl
        for proxy in slot.proxies:
            proxy.set_mode(mode, delay)
        await anyio.sleep(length)  # the fault's length, not a synchronisation
        for proxy in slot.proxies:
            proxy.heal()
        detail = "blackhole" if mode == "blackhole" else f"latency {delay * 1000:.0f} ms"
        self._fault("partition", slot.label, start, detail)

    async def clock(self, tg: anyio.abc.TaskGroup) -> None:
        slot = self._pick(holders_first=False)
        worker = slot.worker
        assert worker is not None
        rate = 0.5 if sum(f.kind == "clock" for f in self.report.faults) % 2 == 0 else 2.0
        start = time.monotonic()
        await worker.send(f"clock {rate}")
        await anyio.sleep(3 * self.ttl)  # the fault's length
        if slot.worker is worker:
            with contextlib.suppress(WorkerFailed):
                await worker.send("clock 1")
        self._fault("clock", slot.label, start, f"clock runs at {rate}x")

    async def _schedule(self, tg: anyio.abc.TaskGroup, end: float) -> None:
        skipped = {s.split(":", 1)[0] for s in self.report.skipped}
        kinds = [k for k in self.faults if k not in skipped]
        if not kinds:
            return
        interval = self.interval or max(
            2.5 * self.ttl, (end - time.monotonic()) / (2 * len(kinds) + 1)
        )
        at = time.monotonic() + interval / 2
        for i in range(10**9):
            # Every fault asked for runs at least once, even when a slow machine (or a
            # short drill) leaves no time for it: then the drill runs a little longer.
            if at + self.ttl > end and i >= len(kinds):
                return
            await anyio.sleep(max(0.0, at - time.monotonic()))
            await getattr(self, kinds[i % len(kinds)])(tg)
            at = max(at + interval, time.monotonic() + 0.1)

    async def _progress(self, start: float, end: float) -> None:
        while self.progress is not None:
            self.progress(time.monotonic() - start, end - start, self.report.counters())
            await anyio.sleep(0.25)

    async def run(self, duration: float) -> None:
        async with self.group, anyio.create_task_group() as tg:
            if self.dep.kind != "sqlite" and "partition" in self.faults:
                scheme, auth, endpoints, rest = _split(self.dep.url)
                for slot in self.slots:
                    slot.proxies = [Proxy(ep) for ep in endpoints]
                    for proxy in slot.proxies:
                        await tg.start(proxy.serve)
                    slot.url = _join(
                        scheme, auth, [("127.0.0.1", p.port) for p in slot.proxies], rest
                    )
            for slot in self.slots:
                slot.url = slot.url or self.dep.url
            register = open_register(self.dep.register)
            await register.setup()
            await register.aclose()
            async with anyio.create_task_group() as starting:
                for slot in self.slots:
                    starting.start_soon(self._start, slot, tg)
            self.report.start = start = time.monotonic()
            end = start + duration
            tg.start_soon(self._progress, start, end)
            with anyio.move_on_after(duration + 10 * self.ttl + 30):
                await self._schedule(tg, end)
            await anyio.sleep(max(0.0, end - time.monotonic()))
            await self._stop()
            self.report.end = time.monotonic()
            tg.cancel_scope.cancel()
        register = open_register(self.dep.register)
        try:
            self.report.final = await register.read(None)
            self.report.applied = await register.applied()
        finally:
            await register.aclose()

    async def _stop(self) -> None:
        for slot in self.slots:
            for proxy in slot.proxies:
                proxy.heal()
        for slot in self.slots:
            if slot.worker is not None:
                if slot.paused:
                    slot.worker.resume()
                with contextlib.suppress(WorkerFailed):
                    await slot.worker.send("stop")
        for slot in self.slots:
            if slot.worker is not None:
                code = await slot.worker.wait(max(15.0, 8 * self.ttl))
                if code is None:
                    self.report.problems.append(f"{slot.label} did not stop in time; killed")
        if self.killed_node is not None:
            with contextlib.suppress(Exception):
                self.killed_node.restart(keep_data=False)


def _judge(report: DrillReport) -> None:
    problems = report.problems
    if report.lost_updates:
        problems.append(
            f"{report.lost_updates} of {max(report.applied, report.accepted)} accepted updates "
            "were lost "
            f"(the register reads {report.final})"
        )
    # In the store's own order (the value each accepted write carried), tokens must rise.
    accepted = sorted(
        ((v, w.at, w) for v, w in zip(report.values, report.writes, strict=True) if w.accepted),
        key=lambda x: (x[0], x[1]),
    )
    for (_, _, a), (_, _, b) in itertools.pairwise(accepted):
        if not b.token > a.token:
            problems.append(
                f"accepted writes out of token order: {a.worker} wrote with {a.token}, "
                f"then {b.worker} with {b.token}"
            )
    problems += [
        f"tokens did not increase: {a.worker} held {a.token}, then {b.worker} got {b.token}"
        for a, b in tokens_out_of_order(report.holds)
    ]


@contextlib.asynccontextmanager
async def _deployment(
    url: str | None,
    spawn: str | None,
    faults: Sequence[str],
    allow_remote_faults: bool,
    tmp: Path,
    run_id: str,
) -> AsyncIterator[Deployment]:
    if (url is None) == (spawn is None):
        raise ValueError(
            "give exactly one of url= (your deployment) or spawn= (one of "
            f"{', '.join(SPAWN)}: throwaway servers on this machine)"
        )
    if spawn is not None:
        if spawn not in SPAWN:
            raise ValueError(f"spawn must be one of {', '.join(SPAWN)}, got {spawn!r}")
        # Starting servers blocks (and PostgreSQL's set-up runs an event loop of its own).
        stack = contextlib.ExitStack()
        dep = await anyio.to_thread.run_sync(stack.enter_context, _spawned(spawn, tmp, run_id))
        try:
            yield dep
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)
        return
    assert url is not None
    kind = check_url(url, faults, allow_remote_faults)
    yield Deployment(kind, url, _register_for(kind, url, tmp, run_id))


async def run_async(
    url: str | None = None,
    *,
    spawn: str | None = None,
    workers: int = 4,
    duration: float = 10.0,
    faults: Sequence[str] = FAULTS,
    fence: bool = True,
    ttl: float = 0.5,
    report_dir: str | os.PathLike[str] | None = None,
    allow_remote_faults: bool = False,
    progress: Progress | None = None,
    seed: int | None = None,
    fault_interval: float | None = None,
    work: float = 0.005,
) -> DrillReport:
    """:func:`run`, awaitable (inside your own event loop)."""
    faults = tuple(dict.fromkeys(faults))
    _check(workers, duration, ttl, faults)
    run_id = secrets.token_hex(4)
    name = f"asynclock-drill-{run_id}"
    with tempfile.TemporaryDirectory(prefix="asynclock-drill-") as tmp_name:
        tmp = Path(tmp_name)
        async with _deployment(url, spawn, faults, allow_remote_faults, tmp, run_id) as dep:
            report = DrillReport(dep.kind, dep.url, fence, workers, duration, ttl)
            if dep.kind == "sqlite" and "partition" in faults:
                report.skipped.append("partition: SQLite has no network to partition")
            rng = random.Random(seed)
            drill = Drill(
                dep,
                report,
                name=name,
                workers=workers,
                faults=faults,
                fence=fence,
                ttl=ttl,
                tmp=tmp,
                progress=progress,
                rng=rng,
                interval=fault_interval,
                work=work,
            )
            await drill.run(duration)
        _judge(report)
        if report_dir is not None:
            save(report, Path(report_dir))
    return report


def run(url: str | None = None, **options: Any) -> DrillReport:
    """Run a drill and return its :class:`DrillReport` (``report.ok``: nothing was lost).

    Give either ``url`` (your deployment: ``sqlite:///...``, ``redis://...``,
    ``redlock://h1,h2,h3``, ``postgresql://...``; faults only against loopback hosts unless
    ``allow_remote_faults=True``) or ``spawn=`` one of :data:`SPAWN` (throwaway servers).

    Options: ``workers`` (processes, default 4), ``duration`` (seconds, default 10),
    ``faults`` (any of :data:`FAULTS`, default all), ``fence`` (default True; False runs the
    same schedule unfenced), ``ttl`` (lease seconds, default 0.5), ``report_dir`` (write
    ``history.jsonl``, ``report.json`` and ``report.html`` there), ``progress`` (called
    about 4 times a second with (elapsed, planned, counters)), ``seed`` (which workers the
    faults hit), ``fault_interval`` (seconds between faults; default: spread over the run).

    Raises ``ValueError`` for bad options, before anything starts.
    """
    return anyio.run(lambda: run_async(url, **options))


def save(report: DrillReport, directory: Path) -> None:
    """Write ``history.jsonl``, ``report.json`` and ``report.html`` into ``directory``."""
    from ._harness.report import render_html

    directory.mkdir(parents=True, exist_ok=True)
    history = directory / "history.jsonl"
    history.unlink(missing_ok=True)
    write_jsonl(history, [*report.holds, *report.writes])
    (directory / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (directory / "report.html").write_text(render_html(report), encoding="utf-8")
    report.report_dir = directory
