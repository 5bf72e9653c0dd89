"""The drill's run: its worker processes, the recorder that turns their events into the
history, and the fault schedule (pause, partition, kill, clock) that attacks them."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .deployment import Deployment, LockServer, join_url, split_url
from .history import Hold, Write
from .process import Worker, WorkerFailed, WorkerGroup
from .proxy import Proxy
from .register import open_register
from .report import DrillReport, Fault

#: The faults a drill runs by default, in the order a schedule cycles through them.
FAULTS = ("pause", "partition", "kill", "clock")
#: Faults a drill runs only when asked for, on servers it started: ``restart`` (a lock
#: server killed and restarted without its data: the restart grace) and ``failover`` (a
#: replica promoted: Sentinel's, or a cluster's).
MORE_FAULTS = ("restart", "failover")
#: Every fault the drill knows.
ALL_FAULTS = FAULTS + MORE_FAULTS
#: Bound on a worker's start (Python, imports, connect).
START_TIMEOUT = 30.0
#: Progress callback: (seconds elapsed, seconds planned, counters so far).
Progress = Callable[[float, float, dict[str, int]], None]


class Recorder:
    """Builds the history from the workers' events, and lets the fault schedule wait on it."""

    def __init__(self, report: DrillReport, name: str) -> None:
        self.report = report
        self.name = name
        #: label -> (token, start, sent) of the hold each worker is in.
        self.open: dict[str, tuple[int, float, float]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._changed = anyio.Event()

    def close_hold(self, label: str, t: float, ended: str = "") -> None:
        if label in self.open:
            token, start, sent = self.open.pop(label)
            self.report.holds.append(Hold(label, start, t, token, self.name, sent, ended))
            self.report.sent.append(sent)

    def feed(self, label: str, event: dict[str, Any]) -> None:
        kind, t = event.get("event"), float(event.get("t", time.monotonic()))
        if kind == "acquired":
            self.close_hold(label, t)
            self.open[label] = (int(event["token"]), t, float(event.get("sent", t)))
        elif kind in ("released", "lost"):
            self.close_hold(label, float(event.get("held_until") or t), kind)
            self.report.lost_leases += kind == "lost"
        elif kind == "read_rejected":
            self.report.read_rejections += 1
        elif kind in ("wrote", "late_write"):
            token, accepted = int(event["token"]), bool(event["accepted"])
            value, late = int(event["value"]), kind == "late_write"
            self.report.writes.append(Write(label, t, token, accepted, "register", value, late))
            self.report.values.append(value)
            self.report.late.append(late)
        elif kind == "backend_error":
            self.report.backend_errors += 1
            if event.get("token") is not None:
                self.close_hold(label, float(event.get("held_until") or t), "error")
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
        #: A cluster's node that is down (it comes back at the next server kill).
        self.killed: LockServer | None = None
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
        holders = [s for s in live if s.label in self.recorder.open]
        return self.rng.choice(holders if holders_first and holders else live)

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
        if self.dep.servers and self.kills % 2 == 1:  # servers first: short drills too
            await self._kill_server()
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

    async def _kill_server(self) -> None:
        servers, start = self.dep.servers, time.monotonic()
        if len(servers) > 1:
            # A cluster loses one node at a time: the one killed before comes back first.
            if self.killed is not None:
                await anyio.to_thread.run_sync(self.killed.start)
                self.report.outages[-1] = (self.report.outages[-1][0], time.monotonic())
            server = self.rng.choice([s for s in servers if s is not self.killed])
            await anyio.to_thread.run_sync(server.kill)
            self.killed = server
            self.report.outages.append((start, float("inf")))
            detail = f"kill -9 a lock node; it restarts {server.comes_back} at the next node kill"
            self._fault("kill", f"node {server.address}", start, detail)
            return
        server = servers[0]
        with anyio.CancelScope(shield=True):  # a drill that ends now still gets it back
            await anyio.to_thread.run_sync(server.kill)
            # The outage's length, not a synchronisation: long enough for the holder's
            # lease to run out while its server is gone.
            await anyio.sleep(2 * self.ttl)
            await anyio.to_thread.run_sync(server.start)
        back = time.monotonic()
        self.report.outages.append((start, back))
        down = f"down {(back - start) * 1000:.0f} ms"
        detail = f"kill -9 the lock server; {down}, back {server.comes_back}"
        self._fault("kill", f"server {server.address}", start, detail)

    async def restart(self, tg: anyio.abc.TaskGroup) -> None:
        """kill -9 a lock server and start it again at once without its data: the holders
        lose their leases at the reconnect, and no lock is granted for the restart grace."""
        servers = [s for s in self.dep.servers if s is not self.killed]
        server, start = self.rng.choice(servers), time.monotonic()
        with anyio.CancelScope(shield=True):  # a drill that ends now still gets it back
            await anyio.to_thread.run_sync(server.kill)
            if server.wipe is not None:
                await anyio.to_thread.run_sync(server.wipe)
            await anyio.to_thread.run_sync(server.start)
        self.report.outages.append((start, time.monotonic()))
        detail = "kill -9 and start again without its data: the restart grace"
        self._fault("restart", f"server {server.address}", start, detail)

    async def failover(self, tg: anyio.abc.TaskGroup) -> None:
        """A replica is promoted. On Sentinel, a holder is cut off from the sentinels first
        (the split brain: it still reaches the old primary, writable for ~10 s); the fault
        lasts until another worker has written after the promotion, and 2 ttl more."""
        promote = self.dep.failover
        assert promote is not None
        if self.killed is not None:  # one node down at a time: the one killed comes back
            await anyio.to_thread.run_sync(self.killed.start)
            self.report.outages[-1] = (self.report.outages[-1][0], time.monotonic())
            self.killed = None
        slot, start = self._pick(), time.monotonic()
        cut = self.dep.split and bool(slot.proxies)
        if cut:
            for proxy in slot.proxies:
                proxy.set_mode("blackhole")
        try:
            detail = await anyio.to_thread.run_sync(promote, self.name)
            promoted = time.monotonic()
            successor = lambda label, ev: (  # noqa: E731
                label != slot.label and ev.get("event") == "wrote" and float(ev["t"]) > promoted
            )
            await self.recorder.wait_for(successor, 10 + 6 * self.ttl)
            await anyio.sleep(2 * self.ttl)  # the fault's length: the split brain, shown
        finally:
            for proxy in slot.proxies:
                proxy.heal()
        if cut:
            detail += f"; {slot.label} was cut off from the sentinels meanwhile"
        self._fault("failover", slot.label if cut else "primary", start, detail)

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
            cuts = "partition" in self.faults or (self.dep.split and "failover" in self.faults)
            if self.dep.kind != "sqlite" and cuts:
                scheme, auth, endpoints, rest = split_url(self.dep.url)
                for slot in self.slots:
                    slot.proxies = [Proxy(ep) for ep in endpoints]
                    for proxy in slot.proxies:
                        await tg.start(proxy.serve)
                    slot.url = join_url(
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
        if self.killed is not None:
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(self.killed.start)
            self.report.outages[-1] = (self.report.outages[-1][0], time.monotonic())
