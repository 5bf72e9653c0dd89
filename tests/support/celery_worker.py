"""A real ``celery worker`` subprocess on a Redis broker the suite starts.

The worker runs ``tests.integrations.celery_tasks`` with the pool, concurrency and lock
URL a test module asks for; tasks report events to a Redis list (``events``) that
:meth:`CeleryWorker.expect` pops with a timeout (BLPOP), so tests never poll or sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from .redis_servers import RedisFactory, RedisServer

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CeleryWorker:
    """One worker process; ``events`` is the Redis list its tasks report to."""

    process: subprocess.Popen[bytes]
    events_url: str
    queue: str
    fence_db: str
    log: Path
    seen: list[dict[str, Any]] = field(default_factory=list)

    def expect(self, event: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The next event called ``event`` (matching ``match``); others are kept in ``seen``."""
        client = redis.Redis.from_url(self.events_url, socket_timeout=timeout + 10)
        for earlier in self.seen:
            if earlier["event"] == event and all(earlier.get(k) == v for k, v in match.items()):
                self.seen.remove(earlier)
                return earlier
        while True:
            popped = client.blpop(["events"], timeout=timeout)
            if popped is None:
                raise AssertionError(
                    f"no {event!r} event {match} within {timeout}s; seen {self.seen}; "
                    f"worker log:\n{self.log.read_text()[-4000:]}"
                )
            got: dict[str, Any] = json.loads(popped[1])
            if got["event"] == event and all(got.get(k) == v for k, v in match.items()):
                return got
            self.seen.append(got)

    def go(self, key: str) -> None:
        redis.Redis.from_url(self.events_url).rpush(f"go:{key}", "1")

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), SIGKILL if it hangs; stopped children are resumed."""
        if self.process.poll() is None:
            _resume_children(self.process.pid)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _resume_children(pid: int) -> None:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGCONT)


@pytest.fixture(scope="session")
def celery_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of its own for the broker, results and events (db 1, 2, 3)."""
    factory = RedisFactory(tmp_path_factory.mktemp("celery-redis"))
    try:
        yield factory()
    finally:
        factory.close()


def redis_db(server: RedisServer, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


def start_celery_worker(
    server: RedisServer,
    directory: Path,
    *,
    pool: str,
    concurrency: int,
    lock_url: str,
    ttl: float,
    env: dict[str, str] | None = None,
) -> CeleryWorker:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    events = redis_db(server, 3)
    redis.Redis.from_url(events).flushdb()
    fence_db = str(directory / "resource.db")
    log = directory / "worker.log"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ALT_BROKER": redis_db(server, 1),
        "ALT_RESULTS": redis_db(server, 2),
        "ALT_EVENTS": events,
        "ALT_LOCK_URL": lock_url,
        "ALT_FENCE_DB": fence_db,
        "ALT_TTL": str(ttl),
        **(env or {}),
    }
    args = [
        sys.executable, "-m", "celery", "-A", "tests.integrations.celery_tasks", "worker",
        "-P", pool, "-c", str(concurrency), "-Q", queue, "-O", "fair",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "--loglevel", "INFO", "-n", f"{queue}@%h",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=out)
    worker = CeleryWorker(process, events, queue, fence_db, log)
    try:
        worker.expect("worker_ready", timeout=60)
    except BaseException:
        worker.stop()
        raise
    return worker
