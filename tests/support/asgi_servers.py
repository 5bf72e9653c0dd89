"""Real uvicorn servers for the FastAPI tests: each in a thread with its own event loop.

A server thread is a real HTTP server on a free loopback port (httpx talks to it over
TCP); it shares the test's process, so a test can hand it gates (``threading.Event``) and
read what its endpoints recorded. ``LogRecorder`` keeps every log record the servers emit,
to check that nothing was logged with a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import uvicorn

from asynclock._harness.servers import free_port as free_port

T = TypeVar("T")


class ServerThread:
    """``uvicorn.Server`` running ``app`` (lifespan on) in a daemon thread."""

    def __init__(self, app: Any, *, port: int | None = None) -> None:
        self.port = port or free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            lifespan="on",
            log_config=None,  # records propagate to the root logger (LogRecorder sees them)
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start() / stop()
            self.error = exc

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self, timeout: float = 30) -> ServerThread:
        self.thread.start()
        give_up = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"uvicorn on port {self.port} exited: {self.error!r}")
            if time.monotonic() > give_up:
                raise RuntimeError(f"uvicorn on port {self.port} did not start in {timeout}s")
            time.sleep(0.005)  # polling for readiness, not a guess
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"uvicorn on port {self.port} did not stop in {timeout}s")

    def call(self, func: Callable[[], T], timeout: float = 10) -> T:
        """Run ``func()`` on the server's event loop thread and return its result."""
        assert self.loop is not None
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((True, func()))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

        self.loop.call_soon_threadsafe(run)
        if not done.wait(timeout):
            raise TimeoutError(f"the server loop did not run the call within {timeout}s")
        ok, value = box[0]
        if not ok:
            raise value
        result: T = value
        return result


@contextmanager
def serving(app: Any) -> Iterator[ServerThread]:
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


class LogRecorder(logging.Handler):
    """Every record logged while installed (on the root logger, all levels)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.records.append(record)

    def tracebacks(self) -> list[str]:
        """Records carrying a traceback, or mentioning a CancelledError, as text."""
        with self._lock:
            records = list(self.records)
        bad = []
        for record in records:
            text = record.getMessage()
            if record.exc_info or record.exc_text or "CancelledError" in text:
                bad.append(f"{record.name} {record.levelname}: {text} {record.exc_info!r}")
        return bad

    def messages(self, logger: str) -> list[str]:
        with self._lock:
            return [r.getMessage() for r in self.records if r.name.startswith(logger)]


@contextmanager
def recording_logs() -> Iterator[LogRecorder]:
    recorder = LogRecorder()
    root = logging.getLogger()
    old = root.level
    root.addHandler(recorder)
    root.setLevel(logging.DEBUG)
    try:
        yield recorder
    finally:
        root.removeHandler(recorder)
        root.setLevel(old)


async def wait_thread_event(event: threading.Event, timeout: float = 20) -> None:
    """Wait (without blocking this loop) until another thread sets ``event``."""
    with anyio.fail_after(timeout):
        while not event.is_set():
            await anyio.to_thread.run_sync(event.wait, 0.2)
