"""Real ZooKeeper servers for the tests, on free loopback ports, data in temporary dirs.

Run from Debian's ``zookeeper`` package jars with a headless JRE (.ci/run installs both when
missing) and the suite's own config: ``admin.enableServer=false`` (or Jetty takes :8080),
a short tick, and a ``maxSessionTimeout`` that allows the driver's default. Provides the
conformance fixture ``spec_zookeeper`` (one server for the session), ``zk_ensemble3`` (three
members, for leader kills) and ``zk_factory`` for tests that kill or restart their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import asynclock
from asynclock.backends.zookeeper._paths import lock_path

from .redis_servers import free_port
from .spec import BackendSpec

JAR = Path("/usr/share/java/zookeeper.jar")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
TICK_MS = 200


def _java() -> str:
    java = shutil.which("java")
    if java is None or not JAR.exists():
        pytest.fail(
            "the ZooKeeper tests need Debian's zookeeper and default-jre-headless packages "
            "(.ci/run installs them)"
        )
    return java


def four_letter(port: int, word: bytes, timeout: float = 0.5) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(word)
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


@dataclass
class ZkNode:
    """One ZooKeeper server: ``kill``, ``start`` it again (same ports, same data)."""

    sid: int
    directory: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    election_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def write_config(self, members: list[ZkNode]) -> Path:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={TICK_MS}",
            f"dataDir={data}",
            f"clientPort={self.client_port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "minSessionTimeout=400",
            "maxSessionTimeout=60000",
            "4lw.commands.whitelist=ruok,srvr,stat,conf",
            "initLimit=20",
            "syncLimit=10",
            "forceSync=no",
        ]
        if len(members) > 1:
            (data / "myid").write_text(f"{self.sid}\n")
            lines += [f"server.{m.sid}=127.0.0.1:{m.peer_port}:{m.election_port}" for m in members]
        config = self.directory / "zoo.cfg"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self, members: list[ZkNode]) -> None:
        config = self.write_config(members)
        args = [
            _java(), "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Dzookeeper.log.dir=" + str(self.directory),
            "-cp", str(JAR), MAIN, str(config),
        ]  # fmt: skip
        log = (self.directory / "server.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def mode(self) -> str | None:
        """ "leader", "follower" or "standalone" once it serves; None before."""
        try:
            text = four_letter(self.client_port, b"srvr")
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()
        self.process = None


class ZkEnsemble:
    """``size`` servers started together; ``url`` lists every client endpoint."""

    def __init__(self, root: Path, size: int) -> None:
        self.nodes = [ZkNode(i + 1, root / f"n{i + 1}") for i in range(size)]

    @property
    def hosts(self) -> str:
        return ",".join(n.address for n in self.nodes)

    @property
    def url(self) -> str:
        return f"zookeeper://{self.hosts}"

    def start(self) -> ZkEnsemble:
        for node in self.nodes:
            node.start(self.nodes)
        self.wait_serving()
        return self

    def wait_serving(self, timeout: float = 60) -> None:
        give_up = time.monotonic() + timeout
        while not all(n.mode() for n in self.nodes if n.process is not None):
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    log = (node.directory / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"zookeeper {node.sid} exited: {log[-2000:]}")
            if time.monotonic() > give_up:
                raise RuntimeError(f"zookeeper did not serve in {timeout}s")
            time.sleep(0.05)  # polling for readiness, not a guess

    def leader(self) -> ZkNode:
        give_up = time.monotonic() + 30
        while True:
            for node in self.nodes:
                if node.process is not None and node.mode() in ("leader", "standalone"):
                    return node
            if time.monotonic() > give_up:
                raise RuntimeError("no zookeeper leader within 30s")
            time.sleep(0.05)

    def restart(self, node: ZkNode) -> None:
        node.kill()
        node.start(self.nodes)
        self.wait_serving()

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


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


class ZkFactory:
    """Starts ensembles for one test and stops them afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ensembles: list[ZkEnsemble] = []

    def __call__(self, size: int = 1) -> ZkEnsemble:
        ensemble = ZkEnsemble(self.root / f"e{len(self.ensembles)}", size)
        self.ensembles.append(ensemble)
        return ensemble.start()

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
    return BackendSpec(id, ensemble.url, sabotage, options={"session_timeout": 3.0})


@pytest.fixture(scope="session")
def spec_zookeeper(zk_ensemble: ZkEnsemble) -> BackendSpec:
    return _spec("zookeeper", zk_ensemble)


@pytest.fixture(scope="session")
def spec_zookeeper3(zk_ensemble3: ZkEnsemble) -> BackendSpec:
    return _spec("zookeeper3", zk_ensemble3)
