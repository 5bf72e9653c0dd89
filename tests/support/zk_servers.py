"""Real ZooKeeper servers for the tests, on free loopback ports, data in temporary dirs.

Started by the package's own launcher (:class:`asynclock._harness.zookeeper.ZookeeperServers`,
also the drill's): Debian's ``zookeeper`` package jars with a headless JRE (.ci/run installs
both when missing) and the suite's own config: ``admin.enableServer=false`` (or Jetty takes :8080),
a short tick, and a ``maxSessionTimeout`` that allows the driver's default. Provides the
conformance fixture ``spec_zookeeper`` (one server for the session), ``zk_ensemble3`` (three
members, for leader kills) and ``zk_factory`` for tests that kill or restart their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import asynclock
from asynclock._harness.zookeeper import ZookeeperMember as ZkNode
from asynclock._harness.zookeeper import ZookeeperServers, find_zookeeper
from asynclock._harness.zookeeper import zookeeper_four_letter as four_letter
from asynclock.backends.zookeeper._paths import lock_path

from .spec import BackendSpec

__all__ = ["ZkEnsemble", "ZkFactory", "ZkNode", "four_letter", "raw_client"]


class ZkEnsemble(ZookeeperServers):
    """The launcher ``asynclock drill --spawn zookeeper`` uses (``asynclock._harness``), with
    a test failure that says what to install when ZooKeeper is missing."""

    def start(self, *, settle: bool = True) -> ZkEnsemble:
        try:
            find_zookeeper()
        except RuntimeError as missing:
            pytest.fail(str(missing))
        super().start(settle=settle)
        return self


def raw_client(hosts: str, **kwargs: object) -> object:
    """A started kazoo client (the caller stops it): raw access, not asynclock."""
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, **kwargs)
    client.start(timeout=15)
    return client


def delete_lock_nodes(hosts: str, name: str) -> None:
    """Sabotage: delete every contender node of the lock ``name`` with kazoo directly."""
    from kazoo.client import KazooClient

    client: KazooClient = raw_client(hosts)
    try:
        path = lock_path("", name)
        if client.exists(path):
            for child in client.get_children(path):
                client.delete(f"{path}/{child}")
    finally:
        client.stop()
        client.close()


def count_lock_nodes(hosts: str, name: str) -> int:
    """How many contender nodes the lock ``name`` has, read with kazoo directly."""
    from kazoo.client import KazooClient

    client: KazooClient = raw_client(hosts)
    try:
        path = lock_path("", name)
        return len(client.get_children(path)) if client.exists(path) else 0
    finally:
        client.stop()
        client.close()


def delete_children(hosts: str, path: str) -> None:
    """Delete every child of ``path`` with kazoo directly (not asynclock)."""
    from kazoo.client import KazooClient

    client: KazooClient = raw_client(hosts)
    try:
        for child in client.get_children(path) if client.exists(path) else []:
            client.delete(f"{path}/{child}")
    finally:
        client.stop()
        client.close()


class ZkFactory:
    """Starts ensembles for one test and stops them afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ensembles: list[ZkEnsemble] = []

    def __call__(self, size: int = 1, *, fresh: bool = False) -> ZkEnsemble:
        """A started ensemble; ``fresh``: exactly as a user's just-started one is (no wipe
        marker yet, so the restart grace applies as documented)."""
        ensemble = ZkEnsemble(self.root / f"e{len(self.ensembles)}", size)
        self.ensembles.append(ensemble)
        return ensemble.start(settle=not fresh)

    def close(self) -> None:
        for ensemble in self.ensembles:
            ensemble.stop()


@pytest.fixture
def zk_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZkFactory]:
    factory = ZkFactory(tmp_path_factory.mktemp("zk"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="session")
def zk_ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZkEnsemble]:
    ensemble = ZkEnsemble(tmp_path_factory.mktemp("zk-session"), 1)
    try:
        yield ensemble.start()
    finally:
        ensemble.stop()


@pytest.fixture(scope="session")
def zk_ensemble3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZkEnsemble]:
    ensemble = ZkEnsemble(tmp_path_factory.mktemp("zk3-session"), 3)
    try:
        yield ensemble.start()
    finally:
        ensemble.stop()


def _spec(id: str, ensemble: ZkEnsemble) -> BackendSpec:
    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        import anyio.to_thread

        await anyio.to_thread.run_sync(delete_lock_nodes, ensemble.hosts, name)

    # A killed holder's node lasts until its session expires (not its ttl): the conformance
    # tests wait up to 10 s for that, so ask for 3 s sessions (the default is 10 s).
    async def queued(name: str) -> int:
        """The contender nodes of ``name`` (the holder's among them)."""
        import anyio.to_thread

        return await anyio.to_thread.run_sync(count_lock_nodes, ensemble.hosts, name)

    return BackendSpec(id, ensemble.url, sabotage, options={"session_timeout": 3.0}, queued=queued)


@pytest.fixture(scope="session")
def spec_zookeeper(zk_ensemble: ZkEnsemble) -> BackendSpec:
    return _spec("zookeeper", zk_ensemble)


@pytest.fixture(scope="session")
def spec_zookeeper3(zk_ensemble3: ZkEnsemble) -> BackendSpec:
    return _spec("zookeeper3", zk_ensemble3)
