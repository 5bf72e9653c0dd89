"""Run tests/support/worker.py in real subprocesses and talk to it line by line (JSON)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from .spec import BackendSpec

WORKER = Path(__file__).with_name("worker.py")
#: Workers started by the running test; the suite kills leftovers after each test.
STARTED: list[anyio.abc.Process] = []
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    """A worker process; ``events()`` yields the JSON objects it prints."""

    process: anyio.abc.Process
    _buffer: bytes = b""

    async def next_event(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        return event

    async def expect(self, kind: str) -> dict[str, Any]:
        event = await self.next_event()
        assert event["event"] == kind, f"expected {kind!r}, worker said {event}"
        return event

    async def send(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(line.encode() + b"\n")

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.process.pid, sig)

    async def wait(self) -> int:
        return await self.process.wait()


async def start_worker(spec: BackendSpec, **config: Any) -> Worker:
    """Start a worker running ``config["mode"]`` against ``spec``'s server."""
    payload = json.dumps({"url": spec.url, "options": spec.options, **config})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = await anyio.open_process(
        [sys.executable, str(WORKER), payload],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        env=env,
    )
    STARTED.append(process)
    return Worker(process)


def kill_leftovers() -> None:
    """Kill workers a failed test left behind (SIGCONT first: one may be stopped)."""
    while STARTED:
        process = STARTED.pop()
        if process.returncode is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    break
