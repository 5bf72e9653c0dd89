"""Where a drill runs: the lock servers it was given (``url=``) or started (``spawn=``), and
the store its register lives in.

Also the URL handling the drill needs: the endpoints of a network URL (each one gets its own
partition proxy), and the check that faults only reach loopback hosts unless allowed.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio

from .servers import RedisServer, running_pg

#: What ``spawn=`` can start.
SPAWN = ("sqlite", "redis", "redlock", "postgres")

_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "redlock": 6379,
    "postgresql": 5432,
    "postgres": 5432,
    "etcd": 2379,
}


def split_url(url: str) -> tuple[str, str, list[tuple[str, int]], str]:
    """(scheme, auth@ or "", [(host, port)...], rest) of a network URL."""
    scheme, _sep, tail = url.partition("://")
    netloc, slash, rest = tail.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    endpoints = []
    for item in hosts.split(","):
        host, colon, port = (
            item.rpartition(":") if "]" not in item.rsplit(":", 1)[-1] else ("", "", "")
        )
        if not colon:
            host, port = item, ""
        endpoints.append(
            (host.strip("[]") or "127.0.0.1", int(port) if port else _DEFAULT_PORTS.get(scheme, 0))
        )
    return scheme, auth + at, endpoints, slash + rest


def join_url(scheme: str, auth: str, endpoints: Iterable[tuple[str, int]], rest: str) -> str:
    return f"{scheme}://{auth}" + ",".join(f"{h}:{p}" for h, p in endpoints) + rest


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, faults: Sequence[str], allow_remote_faults: bool) -> str:
    """The backend kind of ``url``; ValueError if faults would reach a non-loopback host."""
    scheme = urlsplit(url).scheme.lower()
    kinds = {
        "sqlite": "sqlite",
        "redis": "redis",
        "rediss": "redis",
        "redlock": "redlock",
        "postgresql": "postgres",
        "postgres": "postgres",
    }
    if scheme in ("memory", ""):
        raise ValueError(
            f"url: the drill's workers are separate processes, so they need a shared backend "
            f"(sqlite:///path, redis://, redlock://h1,h2,h3, postgresql://...), got {url!r}"
        )
    # Any other backend (etcd://...) works too: its register is then a local SQLite file.
    kind = kinds.get(scheme, scheme)
    if kind != "sqlite" and faults and not allow_remote_faults:
        remote = [h for _, _, eps, _ in [split_url(url)] for h, _ in eps if not is_loopback(h)]
        if remote:
            raise ValueError(
                f"url: {', '.join(remote)} is not a loopback address; the drill injects faults "
                "(pauses, partitions, kills) only against servers on this machine unless "
                "allow_remote_faults=True (--allow-remote-faults). Use faults=() for a "
                "fault-free run."
            )
    return kind


# -- servers -------------------------------------------------------------------------------


@dataclass
class Deployment:
    kind: str
    url: str
    register: str
    #: Lock servers this drill started (the kill fault may kill one; never the register's).
    servers: list[RedisServer] = field(default_factory=list)


@contextlib.contextmanager
def spawned(kind: str, tmp: Path, run_id: str) -> Any:
    if kind == "sqlite":
        yield Deployment(
            kind, f"sqlite:///{tmp / 'locks.db'}", f"sqlite:{tmp / 'register.db'}#drill"
        )
        return
    if kind == "postgres":
        with running_pg("asynclock-drill-pg-") as pg:
            url = pg.url()
            yield Deployment(kind, url, f"{url}#drill-{run_id}")
        return
    nodes = 1 if kind == "redis" else 3
    servers = [RedisServer(tmp / f"redis{i}") for i in range(nodes)]
    try:
        for server in servers:
            server.start()
        url = (
            servers[0].url
            if kind == "redis"
            else "redlock://" + ",".join(s.address for s in servers)
        )
        yield Deployment(kind, url, f"{servers[0].url}#asynclock-drill:{run_id}", servers)
    finally:
        for server in servers:
            server.stop()


def register_for(kind: str, url: str, tmp: Path, run_id: str) -> str:
    if kind not in ("redis", "redlock", "postgres"):
        return f"sqlite:{tmp / 'register.db'}#drill-{run_id}"
    if kind in ("redis", "redlock"):
        _scheme, auth, endpoints, rest = split_url(url)
        host, port = endpoints[0]
        db = rest if kind == "redis" else ""
        return f"redis://{auth}{host}:{port}{db.partition('?')[0]}#asynclock-drill:{run_id}"
    return f"{url}#drill-{run_id}"


@contextlib.asynccontextmanager
async def deployment(
    url: str | None,
    spawn: str | None,
    faults: Sequence[str],
    allow_remote_faults: bool,
    tmp: Path,
    run_id: str,
) -> AsyncIterator[Deployment]:
    if (url is None) == (spawn is None):
        raise ValueError(
            "give exactly one of url= (your deployment) or spawn= (one of "
            f"{', '.join(SPAWN)}: throwaway servers on this machine)"
        )
    if spawn is not None:
        if spawn not in SPAWN:
            raise ValueError(f"spawn must be one of {', '.join(SPAWN)}, got {spawn!r}")
        # Starting servers blocks (and PostgreSQL's set-up runs an event loop of its own).
        stack = contextlib.ExitStack()
        dep = await anyio.to_thread.run_sync(stack.enter_context, spawned(spawn, tmp, run_id))
        try:
            yield dep
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)
        return
    assert url is not None
    kind = check_url(url, faults, allow_remote_faults)
    yield Deployment(kind, url, register_for(kind, url, tmp, run_id))
