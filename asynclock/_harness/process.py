"""Worker processes: start them, read their JSON events, pause/resume/kill them.

A worker is ``python -m some.module ...`` started with pipes on stdin and stdout. It reports
what it does as JSON objects, one per line on stdout, each with an ``"event"`` name and the
``"t"`` it happened (``time.monotonic()``, system-wide on Linux, so the parent can put the
events of several workers on one time line); :func:`emit` writes them. The parent reads them
with :meth:`Worker.expect` / :meth:`Worker.next_event`, always with a timeout, and gets a
:class:`WorkerFailed` saying which worker did what instead: timed out, exited (with the tail
of its stderr when that went to a file), printed something else, or reported an error.

Workers run the same asynclock as the parent (:func:`worker_env` puts its source root first
on ``PYTHONPATH``). Every started worker is remembered until it has been waited for, so
:func:`kill_leftovers` can end what a failed caller left behind; :class:`WorkerGroup` kills
and reaps its workers on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Required, TypedDict, Unpack

import anyio
import anyio.abc

#: Where this asynclock is imported from: workers must run the same code.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])

#: Workers started and not yet reaped, by pid: :func:`kill_leftovers` ends them.
_live: dict[int, anyio.abc.Process] = {}


class WorkerFailed(Exception):
    """A worker did not report what it was expected to, in time."""


# -- the child's side ----------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """Report ``event`` to the parent: one JSON line on stdout, stamped with ``t``."""
    record = {"event": event, "t": time.monotonic(), **fields}
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def die_with_parent(parent: int) -> None:
    """A frozen worker cannot notice its parent died: let the kernel kill it (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        raise SystemExit(3)


# -- the parent's side ---------------------------------------------------------------------


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker: ours, with asynclock's source root first on the path."""
    path = os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` ("T": stopped), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Worker:
    """One worker process: its JSON events, signals, and its stderr file if it has one."""

    def __init__(
        self,
        label: str,
        process: anyio.abc.Process,
        stderr: Path | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.label = label
        self.process = process
        self.pid = process.pid
        self.stderr = stderr
        #: The bound on a read or wait whose caller gives none.
        self.timeout = timeout
        self._buffer = b""

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def stderr_tail(self, lines: int = 8) -> str:
        """The last ``lines`` of the worker's stderr file, indented, or "" without one."""
        if self.stderr is None:
            return ""
        try:
            text = self.stderr.read_text(errors="replace").strip()
        except OSError:
            return ""
        tail = text.splitlines()[-lines:]
        return ("\n    " + "\n    ".join(tail)) if tail else ""

    async def next_event(
        self, timeout: float | None = None, what: str = "its next event"
    ) -> dict[str, Any]:
        """The next event, whatever it is; :class:`WorkerFailed` after ``timeout`` seconds
        (default: the worker's :attr:`timeout`)."""
        stdout = self.process.stdout
        assert stdout is not None
        timeout = self.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while b"\n" not in self._buffer:
                try:
                    self._buffer += await stdout.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    with anyio.move_on_after(2):
                        await self.process.wait()
                    raise WorkerFailed(
                        f"{self.label} exited (code {self.process.returncode}) before {what}"
                        + self.stderr_tail()
                    ) from None
            line, self._buffer = self._buffer.split(b"\n", 1)
            return self._parse(line)
        raise WorkerFailed(f"{self.label}: no report of {what} within {timeout:g}s")

    def _parse(self, line: bytes) -> dict[str, Any]:
        try:
            event: dict[str, Any] = json.loads(line)
        except ValueError:
            raise WorkerFailed(f"{self.label} printed {line!r} instead of an event") from None
        if not isinstance(event, dict):
            raise WorkerFailed(f"{self.label} printed {line!r} instead of an event")
        return event

    async def next_events(
        self, timeout: float | None = None, what: str = "its next event"
    ) -> list[dict[str, Any]]:
        """The next event and every further one already received (a worker that reports
        many events a second is read a batch at a time, not one wait per event)."""
        events = [await self.next_event(timeout, what)]
        if b"\n" in self._buffer:
            *lines, self._buffer = self._buffer.split(b"\n")
            events += [self._parse(line) for line in lines]
        return events

    async def expect(
        self, kind: str, timeout: float | None = None, what: str | None = None
    ) -> dict[str, Any]:
        """The next event, which must be ``kind``; bounded by ``timeout`` seconds.

        An ``{"event": "error", "message": ...}`` report raises with its message.
        """
        what = what or f"{kind!r}"
        event = await self.next_event(timeout, what)
        if event.get("event") == "error":
            raise WorkerFailed(f"{self.label}: {event.get('message')}" + self.stderr_tail())
        if event.get("event") != kind:
            raise WorkerFailed(f"{self.label} reported {event} when {what} was expected")
        return event

    async def send(self, line: str) -> None:
        """Write ``line`` (plus a newline) to the worker's stdin."""
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send(line.encode() + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            raise WorkerFailed(
                f"{self.label} is gone (code {self.process.returncode}): it cannot read {line!r}"
                + self.stderr_tail()
            ) from None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig``; a worker that already exited is not an error."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def pause(self) -> None:
        """Freeze the worker (SIGSTOP): a long GC pause, a frozen VM."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused worker run again (SIGCONT)."""
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """End the worker at once (SIGKILL; this also ends a paused worker)."""
        self.signal(signal.SIGKILL)

    async def wait_stopped(self, timeout: float) -> None:
        """Wait until the kernel shows the worker stopped (Linux /proc; elsewhere trust it).

        SIGSTOP takes effect asynchronously and there is no event to wait for, so this looks
        at the kernel's state every millisecond, for at most ``timeout`` seconds.
        """
        for _ in range(max(1, int(timeout * 1000))):
            state = process_state(self.pid)
            if state is None or state in ("T", "t"):
                return
            await anyio.sleep(0.001)
        raise WorkerFailed(
            f"{self.label} (pid {self.pid}) did not stop within {timeout:g}s of SIGSTOP"
        )

    async def wait(self, timeout: float | None = None) -> int | None:
        """The worker's exit code, or None if it is still running after ``timeout`` seconds
        (default: the worker's :attr:`timeout`)."""
        with anyio.move_on_after(self.timeout if timeout is None else timeout):
            code = await self.process.wait()
            _live.pop(self.pid, None)
            return code
        return None


class SpawnOptions(TypedDict, total=False):
    """The keyword arguments of :func:`spawn` (and :meth:`WorkerGroup.start`)."""

    label: Required[str]
    stderr: Path | None
    env: Mapping[str, str] | None
    timeout: float


def _create(path: Path) -> BinaryIO:
    return open(path, "wb")


async def spawn(
    argv: Sequence[str],
    *,
    label: str,
    stderr: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> Worker:
    """Start ``python argv...`` as a worker (stdin and stdout are pipes).

    ``stderr``: a file for the worker's stderr (read back only to explain a failure, so no
    pipe needs draining); None leaves it on ours. ``env``: extra environment variables.
    ``timeout``: the worker's default bound on reads and waits.
    """
    with contextlib.ExitStack() as stack:
        err = None if stderr is None else stack.enter_context(_create(stderr))
        process = await anyio.open_process(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=worker_env(env),
        )
    _live[process.pid] = process
    return Worker(label, process, stderr, timeout)


def kill_leftovers() -> None:
    """Kill every started worker not yet reaped (a last resort after a failure)."""
    while _live:
        pid, process = _live.popitem()
        if process.returncode is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


class WorkerGroup:
    """Workers that live as long as an ``async with`` block; killed and reaped on exit."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []

    async def start(self, argv: Sequence[str], **options: Unpack[SpawnOptions]) -> Worker:
        """:func:`spawn` a worker (same options) that this group ends on exit."""
        worker = await spawn(argv, **options)
        self.workers.append(worker)
        return worker

    async def __aenter__(self) -> WorkerGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Kill the workers still running and reap all of them (bounded, shielded)."""
        with anyio.CancelScope(shield=True):
            for worker in self.workers:
                if worker.returncode is None:
                    worker.kill()
                await worker.wait(2.0)
                with contextlib.suppress(Exception):
                    await worker.process.aclose()
