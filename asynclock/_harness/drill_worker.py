"""One drill worker: ``python -m asynclock._harness.drill_worker --url ... --register ...``.

It loops until told ``stop`` (a line on stdin): acquire the lock → read the register
(through the fence) → a little work → write register + 1 through the fence with the
lease's token → release, reporting every step as a JSON event (:func:`~.process.emit`,
stamped with ``time.monotonic()``, system-wide on Linux).

Lines the parent sends on stdin:

* ``stop`` — finish the current cycle, report ``done`` and exit 0;
* ``freeze`` — on the next hold, after the read, report ``freeze_me`` and wait (the parent
  SIGSTOPs it there, past its TTL: the GC pause). Its write is already computed and "on its
  way": when the lease turns out lost, the write is still sent (``late_write``), with the
  old token — the write the fence must reject;
* ``clock RATE`` — from now on this worker's clock runs at RATE times real time (the clock
  fault, through the injectable :class:`~asynclock.Clock`); ``clock 1`` puts it right.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anyio

import asynclock

from .process import die_with_parent
from .register import Register, open_register

#: Events a worker reports even with recording off (``--no-record``: the benchmark's baseline).
ALWAYS = frozenset({"ready", "done", "error", "freeze_me", "clock"})
_record = True
_cycles = 0


#: Step events wait here for the next flush (every FLUSH_EVERY seconds): a write and a
#: flush per step, inside the hold, cost more than the 5 % of a cycle the recorder may.
#: Each event is stamped when it happens, so batching moves no event on the timeline.
_pending: list[str] = []
FLUSH_EVERY = 0.02
#: Events the parent acts on at once: flushed (with everything before them) immediately.
URGENT = ALWAYS | {"lost", "late_write"}


def emit(event: str, **fields: object) -> None:
    """Report ``event`` to the parent, unless recording is off and it is a step event."""
    if not (_record or event in ALWAYS):
        return
    _pending.append(json.dumps({"event": event, "t": time.monotonic(), **fields}))
    if event in URGENT:
        flush()


def flush() -> None:
    if _pending:
        sys.stdout.write("\n".join(_pending) + "\n")
        sys.stdout.flush()
        _pending.clear()


async def _flusher() -> None:
    while True:
        await anyio.sleep(FLUSH_EVERY)
        flush()


class ScaledClock:
    """A monotonic clock that runs ``rate`` times as fast as real time; rate can change."""

    def __init__(self, rate: float = 1.0) -> None:
        self._real0 = time.monotonic()
        self._clock0 = self._real0
        self.rate = rate
        #: (clock0, real0, rate) of each earlier stretch, to map a reading back to real time.
        self._before: list[tuple[float, float, float]] = []

    def now(self) -> float:
        return self._clock0 + (time.monotonic() - self._real0) * self.rate

    def set_rate(self, rate: float) -> None:
        now = self.now()  # re-anchor: the clock never jumps, it only changes speed
        self._before.append((self._clock0, self._real0, self.rate))
        self._real0, self._clock0, self.rate = time.monotonic(), now, rate

    def real(self, reading: float) -> float:
        """The ``time.monotonic()`` at which this clock read ``reading``."""
        stretches = [(self._clock0, self._real0, self.rate), *reversed(self._before)]
        clock0, real0, rate = next((s for s in stretches if reading >= s[0]), stretches[-1])
        return real0 + (reading - clock0) / rate

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(0.0, (deadline - self.now()) / self.rate))


class State:
    def __init__(self, clock: ScaledClock) -> None:
        self.stop = anyio.Event()
        self.freeze = False
        self.clock = clock


async def _commands(state: State, clock: ScaledClock) -> None:
    while True:
        line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        word, _, rest = line.strip().partition(" ")
        if word == "freeze":
            state.freeze = True
        elif word == "clock":
            clock.set_rate(float(rest))
            emit("clock", rate=float(rest))
        elif word == "stop" or not line:
            state.stop.set()
            return


async def _cycle(
    backend: asynclock.Backend, register: Register, args: argparse.Namespace, state: State
) -> None:
    global _cycles
    _cycles += 1
    pending: tuple[int, int] | None = None
    token: int | None = None
    held_until = 0.0
    try:
        async with backend.lock(args.name, ttl=args.ttl, timeout=args.acquire_timeout) as lease:
            token = lease.token
            # sent: when the attempt that got the lease was sent (the grant came after it);
            # the event's own stamp comes after the grant, late if this process was starved.
            emit("acquired", token=token, sent=state.clock.real(lease.acquired_at))
            try:
                # Shielded like the write: a loss that cancels a read inside its database
                # transaction can cancel the ROLLBACK too (asyncpg), leaving the connection
                # in a transaction that holds the fence row locked and never commits
                # (seen as lost updates and 5 s stalls on PostgreSQL under load).
                with anyio.CancelScope(shield=True):
                    value = await register.read(token if args.fence else None)
            except asynclock.StaleToken as exc:
                emit("read_rejected", token=token, mark=exc.current)
                held_until = time.monotonic()
                return
            pending = (token, value + 1)
            emit("read", token=token, value=value)
            if state.freeze:
                state.freeze = False
                emit("freeze_me", token=token)
                # The parent freezes us here and the lease expires; told to stop instead
                # (the drill ended first), we carry on.
                await state.stop.wait()
            await anyio.sleep(args.work)
            # The write is sent: a request on the wire finishes even if the lease is lost
            # meanwhile (the fence, not the lock, decides whether it lands).
            with anyio.CancelScope(shield=True):
                accepted = await register.write(token if args.fence else None, value + 1)
            pending = None
            emit("wrote", token=token, value=value + 1, accepted=accepted)
            held_until = time.monotonic()  # the hold ends as the release begins
        emit("released", token=token, held_until=held_until)
    except asynclock.LeaseLost as exc:
        emit("lost", token=exc.token, reason=exc.reason)
        if pending is not None:
            old, value = pending
            accepted = await register.write(old if args.fence else None, value)
            emit("late_write", token=old, value=value, accepted=accepted)
    except asynclock.AcquireTimeout:
        emit("acquire_timeout")
    except asynclock.AsynclockError as exc:
        # Partitions and killed servers: the acquire failed loudly. Try again soon.
        # A release that failed (its server gone) ends a hold that ended at held_until.
        emit(
            "backend_error",
            error=type(exc).__name__,
            message=str(exc)[:200],
            token=token,
            held_until=held_until or None,
        )
        await anyio.sleep(0.05)


async def _main(args: argparse.Namespace) -> None:
    clock = ScaledClock(args.clock_rate)
    state = State(clock)
    register = open_register(args.register)
    options = {"node_timeout": args.node_timeout} if args.url.startswith("redlock:") else {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_commands, state, clock)
        tg.start_soon(_flusher)
        async with asynclock.connect(args.url, clock=clock, **options) as backend:
            emit("ready")
            started = time.monotonic()
            while not state.stop.is_set():
                await _cycle(backend, register, args, state)
            elapsed = time.monotonic() - started
        await register.aclose()
        emit("done", cycles=_cycles, elapsed=elapsed)
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asynclock._harness.drill_worker")
    parser.add_argument("--url", required=True)
    parser.add_argument("--register", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--work", type=float, default=0.005)
    parser.add_argument("--acquire-timeout", type=float, default=10.0)
    parser.add_argument("--node-timeout", type=float, default=0.5)
    parser.add_argument("--clock-rate", type=float, default=1.0)
    parser.add_argument("--no-fence", dest="fence", action="store_false")
    parser.add_argument("--no-record", dest="record", action="store_false")
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    global _record
    _record = args.record
    die_with_parent(args.parent)
    try:
        anyio.run(_main, args)
    except Exception as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
