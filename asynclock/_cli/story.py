"""``asynclock demo``: a stale lock holder, frozen past its TTL, is stopped by a fencing token.

The story is played by real processes. The parent (``asynclock demo``, :func:`play`) starts
two workers (``python -m asynclock._cli.story worker first|second``) that report JSON lines on
stdout, and waits for those reports — never for a guessed sleep. The only deliberate pause
is the freeze of worker 1 (SIGSTOP), and it lasts exactly until worker 2 reports that it
got the lock and is done, which it can only do once worker 1's lease ran out on the server.

The resource is a SQLite "ledger" (a temp file) guarded by :class:`asynclock.fence.SQLFence`.
Every wait is bounded; the children are killed on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sqlite3
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

import asynclock
from asynclock.fence import SQLFence

from .._harness import Worker, WorkerFailed, WorkerGroup, die_with_parent, emit
from .output import Output, make_output

__all__ = (
    "Deviation",
    "LedgerRow",
    "Output",
    "Say",
    "Story",
    "check",
    "make_output",
    "play",
    "run",
)

#: Fence key and lock name prefix; the ledger row everyone updates.
FENCE_KEY = "ledger"
#: How long a started worker may take to start Python, connect and report.
START_TIMEOUT = 20.0
#: Bound on every other step the parent waits for (beyond the TTL itself).
STEP_TIMEOUT = 10.0
#: "Promptly": LeaseLost must reach worker 1's `async with` within this after SIGCONT.
PROMPT = 1.0
#: Balance story: worker 1 opens at 100, then (from a read of 100) charges a fee of 10;
#: worker 2, after the freeze, reads 100 and records a payment of 30.
OPENING, FEE, PAYMENT = 100, 10, 30

LEDGER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS ledger ("
    " seq INTEGER PRIMARY KEY, writer TEXT NOT NULL, token INTEGER NOT NULL,"
    " balance INTEGER NOT NULL, note TEXT NOT NULL)"
)


# -- the resource: a fenced ledger ---------------------------------------------------------


def ledger_connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=STEP_TIMEOUT)


def create_ledger(path: str) -> None:
    conn = ledger_connect(path)
    try:
        conn.execute(LEDGER_SCHEMA)
        SQLFence().create_sqlite(conn)
    finally:
        conn.close()


def read_balance(path: str) -> int | None:
    conn = ledger_connect(path)
    try:
        row = conn.execute("SELECT balance FROM ledger ORDER BY seq DESC LIMIT 1").fetchone()
        return None if row is None else int(row[0])
    finally:
        conn.close()


def fenced_write(
    path: str, writer: str, token: int, balance: int, note: str
) -> tuple[bool, int | None]:
    """Append a ledger row through the fence (G8). Returns (accepted, fence mark)."""
    conn = ledger_connect(path)
    try:
        with SQLFence().sqlite_transaction(conn, FENCE_KEY, token):
            conn.execute(
                "INSERT INTO ledger (writer, token, balance, note) VALUES (?, ?, ?, ?)",
                (writer, token, balance, note),
            )
    except asynclock.StaleToken as exc:
        return False, exc.current
    finally:
        conn.close()
    return True, token


@dataclass(frozen=True)
class LedgerRow:
    seq: int
    writer: str
    token: int
    balance: int
    note: str


def read_ledger(path: str) -> tuple[list[LedgerRow], int | None]:
    conn = ledger_connect(path)
    try:
        rows = [
            LedgerRow(int(r[0]), str(r[1]), int(r[2]), int(r[3]), str(r[4]))
            for r in conn.execute(
                "SELECT seq, writer, token, balance, note FROM ledger ORDER BY seq"
            )
        ]
        mark = conn.execute(
            "SELECT token FROM asynclock_fence WHERE key = ?", (FENCE_KEY,)
        ).fetchone()
        return rows, None if mark is None else int(mark[0])
    finally:
        conn.close()


# -- the workers (child processes) ---------------------------------------------------------


async def _first(backend: asynclock.Backend, args: argparse.Namespace) -> None:
    pending: tuple[int, int, str] | None = None
    try:
        async with backend.lock(args.name, ttl=args.ttl, timeout=STEP_TIMEOUT) as lease:
            emit("acquired", token=lease.token)
            accepted, _ = fenced_write(args.ledger, "worker 1", lease.token, OPENING, "opened")
            emit("wrote", token=lease.token, balance=OPENING, accepted=accepted)
            # Read-modify-write: the next balance is computed from what we read now.
            seen = read_balance(args.ledger)
            assert seen is not None
            pending = (lease.token, seen - FEE, f"fee {FEE} (from {seen})")
            emit("about_to_write", token=lease.token, seen=seen, balance=pending[1])
            # The parent freezes us here, with the write on its way. Were we not frozen,
            # the write would land now; the lease's cancel scope guards this await.
            await anyio.sleep_forever()
    except asynclock.LeaseLost as exc:
        emit("lost", token=exc.token, reason=exc.reason)
    else:  # pragma: no cover - sleep_forever only ends by cancellation
        emit("error", message="worker 1's body ended without LeaseLost")
        raise SystemExit(1)
    if pending is not None:
        token, balance, note = pending
        # The write it was about to send when it froze (think: a request already in a
        # socket buffer) reaches the ledger now, with its old token.
        accepted, mark = fenced_write(args.ledger, "worker 1", token, balance, note)
        emit("late_write", token=token, balance=balance, accepted=accepted, mark=mark)


async def _second(backend: asynclock.Backend, args: argparse.Namespace) -> None:
    emit("ready")
    line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    if line.strip() != "go":
        raise SystemExit(0)  # the parent went away
    try:
        early = await backend.acquire(args.name, ttl=args.ttl, blocking=False)
    except asynclock.LockHeld as exc:
        emit("busy", retry_after=exc.retry_after)
    else:
        emit("error", message=f"got the lock (token {early.token}) while worker 1 held it")
        await early.release()
        raise SystemExit(1)
    emit("waiting")
    async with backend.lock(args.name, ttl=args.ttl, timeout=args.ttl + STEP_TIMEOUT) as lease:
        emit("acquired", token=lease.token)
        seen = read_balance(args.ledger)
        assert seen is not None
        balance = seen - PAYMENT
        note = f"payment {PAYMENT} (from {seen})"
        accepted, _ = fenced_write(args.ledger, "worker 2", lease.token, balance, note)
        emit("wrote", token=lease.token, seen=seen, balance=balance, accepted=accepted)
    emit("released", token=lease.token)


async def _worker(args: argparse.Namespace) -> None:
    with anyio.fail_after(args.deadline):
        async with asynclock.connect(args.url) as backend:
            await (_first if args.role == "first" else _second)(backend, args)


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m asynclock._cli.story worker")
    parser.add_argument("role", choices=["first", "second"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    try:
        anyio.run(_worker, args)
    except Exception as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


# -- the parent: play the story ------------------------------------------------------------


class Deviation(Exception):
    """The story did not play out as told."""


@dataclass
class Event:
    t: float  # time.monotonic() (system-wide: CLOCK_MONOTONIC on Linux)
    who: str
    token: int | None
    what: str


@dataclass
class Story:
    """What happened. Filled in as the story plays; read by the renderer."""

    url: str
    ttl: float
    ledger: str
    name: str
    start: float = field(default_factory=time.monotonic)
    events: list[Event] = field(default_factory=list)
    token1: int | None = None
    token2: int | None = None
    frozen_at: float | None = None
    expires_at: float | None = None
    w2_acquired_at: float | None = None
    resumed_at: float | None = None
    lost_at: float | None = None
    lost_reason: str | None = None
    late_accepted: bool | None = None
    rows: list[LedgerRow] = field(default_factory=list)
    mark: int | None = None
    deviations: list[str] = field(default_factory=list)

    def log(self, t: float, who: str, token: int | None, what: str) -> None:
        self.events.append(Event(t, who, token, what))

    def ms(self, t: float) -> int:
        return round((t - self.start) * 1000)


#: Narrative sink: ``say(step_number, parts)``; parts are (text, style) pairs.
Say = Callable[[int, list[tuple[str, str]]], None]


@contextlib.asynccontextmanager
async def _workers(story: Story, deadline: float) -> AsyncIterator[list[Worker]]:
    """Start both workers; yield them; kill whatever still runs on exit."""
    async with WorkerGroup() as group:
        procs: list[Worker] = []
        for role, label in (("first", "worker 1"), ("second", "worker 2")):
            argv = [
                "-m", "asynclock._cli.story", "worker", role,
                "--url", story.url, "--name", story.name, "--ttl", repr(story.ttl),
                "--ledger", story.ledger, "--deadline", repr(deadline),
                "--parent", str(os.getpid()),
            ]  # fmt: skip
            # stderr goes to a file (read back only to explain a failure): no pipe to drain.
            stderr = Path(story.ledger).with_name(f"{role}.stderr")
            procs.append(await group.start(argv, label=label, stderr=stderr))
        yield procs


async def _server_expiry(story: Story) -> float:
    """Ask the lock server how long worker 1's lease has left (a non-blocking try)."""
    async with asynclock.connect(story.url) as backend:
        t_send = time.monotonic()
        try:
            lease = await backend.acquire(story.name, ttl=story.ttl, blocking=False)
        except asynclock.LockHeld as exc:
            left = story.ttl if exc.retry_after is None else exc.retry_after
            return t_send + left
        await lease.release()
        raise Deviation("the lock was free right after worker 1 froze: its lease had already ended")


async def play(story: Story, say: Say) -> None:
    """Play the story, narrating through ``say``.

    Raises :class:`Deviation` if it goes off, :class:`WorkerFailed` if a worker does not
    report the next step in time (or exits, or reports an error).
    """
    create_ledger(story.ledger)
    ttl = story.ttl
    deadline = START_TIMEOUT + 4 * STEP_TIMEOUT + 2 * ttl
    async with _workers(story, deadline) as (w1, w2):
        # 1. Worker 1 takes the lock and writes through the fence.
        ev = await w1.expect("acquired", START_TIMEOUT, "worker 1 acquiring the lock")
        n = story.token1 = int(ev["token"])
        story.log(ev["t"], "worker 1", n, "acquired the lock")
        ev = await w1.expect("wrote", STEP_TIMEOUT, "worker 1's first write")
        if not ev["accepted"]:
            raise Deviation(f"the ledger rejected worker 1's first write (token {n})")
        story.log(ev["t"], "worker 1", n, f"wrote balance {ev['balance']} (accepted)")
        say(1, [("worker 1", "w1"), (f" (pid {w1.pid}) acquired {story.name!r}: token ", ""),
                (str(n), "tok"), (f". It writes balance {OPENING} through the fence: ", ""),
                ("accepted", "good"), (".", "")])  # fmt: skip
        about = await w1.expect("about_to_write", STEP_TIMEOUT, "worker 1's second write")
        story.log(about["t"], "worker 1", n, f"about to write balance {about['balance']}")

        # 2. Worker 2 tries, finds it held, and waits.
        await w2.expect("ready", START_TIMEOUT, "worker 2 connecting")
        await w2.send("go")
        ev = await w2.expect("busy", STEP_TIMEOUT, "worker 2's first try")
        story.log(ev["t"], "worker 2", None, "tried: LockHeld")
        ev = await w2.expect("waiting", STEP_TIMEOUT, "worker 2 waiting")
        story.log(ev["t"], "worker 2", None, "waits (blocking acquire)")
        say(2, [("worker 2", "w2"), (f" (pid {w2.pid}) tries the lock: ", ""),
                ("LockHeld", "bad"), (". It waits for it (blocking acquire).", "")])  # fmt: skip

        # 3. Freeze worker 1 with its write on the way.
        w1.pause()
        story.frozen_at = time.monotonic()
        await w1.wait_stopped(STEP_TIMEOUT)
        story.log(story.frozen_at, "demo", n, "froze worker 1 (SIGSTOP)")
        story.expires_at = await _server_expiry(story)
        left = story.expires_at - story.frozen_at
        say(3, [("worker 1", "w1"), (f" read balance {about['seen']} and is about to write ", ""),
                (f"balance {about['balance']}", ""), (" with token ", ""), (str(n), "tok"),
                (" when it ", ""), ("freezes", "bad"),
                (" (SIGSTOP: a long GC pause, a frozen VM). Its heartbeat stops too; the lock "
                 f"server says its lease ends in {left:.2f} s.", "")])  # fmt: skip

        # 4. The lease runs out on the server; worker 2 gets the lock. This wait IS the freeze.
        ev = await w2.expect("acquired", ttl + STEP_TIMEOUT, "worker 2 acquiring the lock")
        m = story.token2 = int(ev["token"])
        story.w2_acquired_at = ev["t"]
        story.log(story.expires_at, "server", n, "worker 1's lease expired (not renewed)")
        story.log(ev["t"], "worker 2", m, "acquired the lock")
        say(4, [("Nobody renewed worker 1's lease, so it expired on the server. ", ""),
                ("worker 2", "w2"), (" acquired the lock: token ", ""), (str(m), "tok"),
                (f" ({'>' if m > n else 'NOT >'} {n}).", "")])  # fmt: skip

        # 5. Worker 2 writes through the fence and releases.
        ev = await w2.expect("wrote", STEP_TIMEOUT, "worker 2's write")
        if not ev["accepted"]:
            raise Deviation(f"the ledger rejected worker 2's write (token {m})")
        story.log(ev["t"], "worker 2", m, f"wrote balance {ev['balance']} (accepted)")
        ev2 = await w2.expect("released", STEP_TIMEOUT, "worker 2 releasing the lock")
        story.log(ev2["t"], "worker 2", m, "released the lock")
        say(5, [("worker 2", "w2"), (f" read balance {ev['seen']}, wrote balance {ev['balance']}"
                " with token ", ""), (str(m), "tok"), (": ", ""), ("accepted", "good"),
                (". It released the lock.", "")])  # fmt: skip

        # 6. Wake worker 1: its lease is gone, so its work is cancelled with LeaseLost.
        story.resumed_at = time.monotonic()  # before: worker 1 may report before we look
        w1.resume()
        story.log(story.resumed_at, "demo", n, "resumed worker 1 (SIGCONT)")
        ev = await w1.expect("lost", PROMPT + STEP_TIMEOUT, "worker 1's LeaseLost")
        story.lost_at, story.lost_reason = ev["t"], str(ev["reason"])
        story.log(ev["t"], "worker 1", n, f"LeaseLost: {story.lost_reason}")
        after = (story.lost_at - story.resumed_at) * 1000
        say(6, [("worker 1", "w1"), (" resumed. Its lease was gone, so its `async with` body was"
                 " cancelled and raised ", ""), ("LeaseLost", "bad"),
                (f" ({story.lost_reason}) {after:.0f} ms after waking.", "")])  # fmt: skip

        # 7. The write it had on the way arrives with the old token: the fence rejects it.
        ev = await w1.expect("late_write", STEP_TIMEOUT, "worker 1's late write")
        story.late_accepted = bool(ev["accepted"])
        verdict = "ACCEPTED (lost update!)" if story.late_accepted else "rejected: StaleToken"
        story.log(ev["t"], "ledger", n, f"worker 1's late write {verdict}")
        say(7, [("The write ", ""), ("worker 1", "w1"), (" was about to send when it froze "
                f"(balance {ev['balance']}, token ", ""), (str(n), "tok"),
                (") reaches the ledger now: ", ""),
                (verdict, "bad" if story.late_accepted else "good"),
                ("." if story.late_accepted else
                 f" (the fence has seen token {ev['mark']}); nothing written.", "")])  # fmt: skip

        for worker in (w1, w2):
            code = await worker.wait(STEP_TIMEOUT)
            if code != 0:
                raise Deviation(f"{worker.label} exited with code {code}" + worker.stderr_tail())
    story.rows, story.mark = read_ledger(story.ledger)


def check(story: Story) -> list[str]:
    """Everything that must hold for the story to count as told; one line per deviation."""
    out: list[str] = []
    n, m = story.token1, story.token2
    if n is None or m is None:
        return ["the story did not reach the point where both workers held the lock"]
    if not m > n:
        out.append(f"tokens did not increase: worker 1 had {n}, worker 2 got {m}")
    expiry, acquired = story.expires_at, story.w2_acquired_at
    if expiry is not None and acquired is not None and acquired < expiry:
        out.append("worker 2 acquired before worker 1's lease expired on the server (G1)")
    if story.lost_at is None:
        out.append("worker 1 never raised LeaseLost")
    elif story.resumed_at is not None and story.lost_at - story.resumed_at > PROMPT:
        ms = (story.lost_at - story.resumed_at) * 1000
        out.append(f"worker 1's LeaseLost came {ms:.0f} ms after it woke (> {PROMPT * 1000:.0f})")
    if story.late_accepted is not False:
        out.append("worker 1's late write was not rejected by the fence")
    got = [(r.writer, r.token, r.balance) for r in story.rows]
    want = [("worker 1", n, OPENING), ("worker 2", m, OPENING - PAYMENT)]
    if got != want:
        out.append(f"the ledger holds {got}, expected exactly the accepted writes {want}")
    if story.mark != m:
        out.append(f"the fence's high-water mark is {story.mark}, expected {m}")
    return out


WHO_STYLE = {"worker 1": "w1", "worker 2": "w2", "demo": "dim", "server": "dim", "ledger": "dim"}


def render_tables(story: Story, out: Output) -> None:
    rows = [
        [str(story.ms(e.t)), e.who, "" if e.token is None else str(e.token), e.what]
        for e in sorted(story.events, key=lambda e: e.t)
    ]
    columns = [("t (ms)", ">"), ("who", "<"), ("token", ">"), ("what happened", "<")]
    out.table("Timeline (ms since the demo started)", columns, rows, WHO_STYLE)
    ledger = [[str(r.seq), r.writer, str(r.token), str(r.balance), r.note] for r in story.rows]
    columns = [("#", ">"), ("writer", "<"), ("token", ">"), ("balance", ">"), ("note", "<")]
    mark = "none" if story.mark is None else str(story.mark)
    out.table(f"Ledger (fence high-water mark: token {mark})", columns, ledger, WHO_STYLE)


async def run(url: str | None, ttl: float, out: Output) -> int:
    """Play and tell the story. 0: as told; 1: it deviated (or could not start)."""
    with tempfile.TemporaryDirectory(prefix="asynclock-demo-") as tmp:
        name = FENCE_KEY if url is None else f"{FENCE_KEY}-{secrets.token_hex(3)}"
        if url is None:
            url = f"sqlite:///{Path(tmp, 'locks.db')}"
        story = Story(url=url, ttl=ttl, ledger=str(Path(tmp, "ledger.db")), name=name)
        out.header(
            "asynclock demo: a lock holder freezes past its lease; the fence stops its write",
            [
                ("backend", url),
                ("lock", f"{name!r}, lease ttl {ttl} s"),
                ("resource", f"a SQLite ledger; every write goes through SQLFence({FENCE_KEY!r})"),
                ("workers", "two separate Python processes, started by this command"),
            ],
        )
        try:
            async with asynclock.connect(url):
                pass  # fail early and clearly if the backend cannot be used
        except asynclock.BackendUnavailable as exc:
            out.verdict(False, "The lock backend could not be used:", [str(exc)], label="ERROR")
            return 1
        try:
            await play(story, lambda n, parts: out.step(n, parts))
        except (Deviation, WorkerFailed) as exc:
            story.deviations.append(str(exc))
            with contextlib.suppress(Exception):
                story.rows, story.mark = read_ledger(story.ledger)
        else:
            story.deviations.extend(check(story))
        render_tables(story, out)
        if story.deviations:
            out.verdict(False, "The story did not play out as told:", story.deviations)
            return 1
        n, m = story.token1, story.token2
        out.verdict(
            True,
            "The story played out as told.",
            [
                f"tokens went up: worker 1 held {n}, worker 2 got {m}",
                f"worker 1 was cancelled and raised LeaseLost ({story.lost_reason})",
                f"its late write with token {n} was rejected by the fence (StaleToken)",
                f"the ledger holds exactly the {len(story.rows)} accepted writes "
                f"(balance {story.rows[-1].balance})",
                "a lock alone cannot stop a paused holder; the token checked at the resource can",
            ],
        )
        return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["worker"]:
        return worker_main(args[1:])
    print("usage: python -m asynclock._cli.story worker ... (run `asynclock demo` instead)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
