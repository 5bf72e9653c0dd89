"""A throwaway ZooKeeper ensemble on free loopback ports (Debian's ``zookeeper`` jars and a
JRE): what ``asynclock drill --spawn zookeeper`` and the test suite
(``tests/support/zk_servers.py``) start. Every member listens on 127.0.0.1 only."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .servers import _kill, free_port

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
ZOOKEEPER_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
#: The ensemble's tick: sessions down to 2 ticks (0.4 s), quick elections on loopback.
ZOOKEEPER_TICK_MS = 200


def find_zookeeper() -> tuple[str, Path]:
    """(``java``, the server jar); RuntimeError if either is missing."""
    java = shutil.which("java")
    if java is None or not ZOOKEEPER_JAR.exists():
        raise RuntimeError(
            "ZooKeeper needs Debian's zookeeper and default-jre-headless packages "
            "(Debian packages zookeeper and default-jre-headless; .ci/run installs them)"
        )
    return java, ZOOKEEPER_JAR


def zookeeper_four_letter(port: int, word: bytes, timeout: float = 0.5) -> str:
    """A four-letter word (``srvr``, ``ruok``...) to the server on ``port``; its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(word)
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


@dataclass
class ZookeeperMember:
    """One member of a :class:`ZookeeperServers` ensemble: ``kill`` it, ``start`` it again
    (same ports, same data directory: its transaction log and snapshots)."""

    cluster: ZookeeperServers
    sid: int
    directory: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    election_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def write_config(self) -> Path:
        members = self.cluster.members
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={ZOOKEEPER_TICK_MS}",
            f"dataDir={data}",
            f"clientPort={self.client_port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",  # or Jetty takes :8080
            f"minSessionTimeout={2 * ZOOKEEPER_TICK_MS}",
            "maxSessionTimeout=60000",
            "4lw.commands.whitelist=ruok,srvr,stat,conf",
            "initLimit=20",
            "syncLimit=10",
            # ZooKeeper's default fsyncs every transaction; the tests' throwaway servers skip it.
            f"forceSync={'yes' if self.cluster.durable else 'no'}",
        ]
        if len(members) > 1:
            (data / "myid").write_text(f"{self.sid}\n")
            lines += [f"server.{m.sid}=127.0.0.1:{m.peer_port}:{m.election_port}" for m in members]
        config = self.directory / "zoo.cfg"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> None:
        """Start the member (it joins the quorum: :meth:`ZookeeperServers.wait_serving`)."""
        java, jar = find_zookeeper()
        config = self.write_config()
        args = [
            java, f"-Xmx{self.cluster.heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Dzookeeper.log.dir=" + str(self.directory),
            "-cp", str(jar), ZOOKEEPER_MAIN, str(config),
        ]  # fmt: skip
        with (self.directory / "server.log").open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def mode(self) -> str | None:
        """ "leader", "follower" or "standalone" once it serves (in the quorum); None before."""
        try:
            text = zookeeper_four_letter(self.client_port, b"srvr")
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def kill(self) -> None:
        """``kill -9``."""
        _kill(self.process)
        self.process = None

    def wipe(self) -> None:
        """Delete its data (transaction log, snapshots, epochs; not its id): its next
        start is an empty server's. Stop it first."""
        shutil.rmtree(self.directory / "data" / "version-2", ignore_errors=True)


class ZookeeperServers:
    """A throwaway ZooKeeper ensemble of ``size`` members on free loopback ports, run from
    Debian's jars. ``durable``: fsync every transaction (ZooKeeper's default)."""

    def __init__(
        self, root: Path, size: int = 3, *, durable: bool = False, heap: str = "128m"
    ) -> None:
        self.root = root
        self.durable = durable
        #: Each member's Java heap (``-Xmx``): 128 MB is plenty for tests; ~100,000 live
        #: sessions' nodes and watches need about 1 GB (bench_scale).
        self.heap = heap
        self.members = [ZookeeperMember(self, i + 1, root / f"n{i + 1}") for i in range(size)]

    @property
    def nodes(self) -> list[ZookeeperMember]:
        return self.members

    @property
    def hosts(self) -> str:
        return ",".join(m.address for m in self.members)

    @property
    def url(self) -> str:
        return f"zookeeper://{self.hosts}"

    def start(self, *, settle: bool = True) -> ZookeeperServers:
        """Start every member. ``settle``: write the wipe marker as an ensemble long in
        service has it, so the first acquisition waits no restart grace (the grace of a
        fresh or wiped ensemble is what the tests of it check)."""
        for member in self.members:
            member.start()
        self.wait_serving()
        if settle:
            self.settle()
        return self

    def settle(self, chroot: str = "") -> None:
        """Mark the data under ``chroot`` as in service for long: no restart grace is due."""
        from kazoo.client import KazooClient
        from kazoo.exceptions import NodeExistsError

        from ..backends.zookeeper._era import MARKER, SETTLED

        client = KazooClient(hosts=self.hosts + chroot)
        client.start(timeout=30)
        try:
            try:
                client.create(MARKER, SETTLED)
            except NodeExistsError:
                client.set(MARKER, SETTLED)
        finally:
            client.stop()
            client.close()

    def wait_serving(self, timeout: float = 60) -> None:
        """Until every running member serves: a restarted one has rejoined the quorum."""
        give_up = time.monotonic() + timeout
        while not all(m.mode() for m in self.members if m.process is not None):
            for m in self.members:
                if m.process is not None and m.process.poll() is not None:
                    log = (m.directory / "server.log").read_text(errors="replace")
                    raise RuntimeError(f"zookeeper member {m.sid} exited: {log[-2000:]}")
            if time.monotonic() > give_up:
                where = f"the zookeeper ensemble in {self.root}"
                raise RuntimeError(f"{where} did not serve in {timeout}s")
            time.sleep(0.05)  # polling for readiness, not a guess

    def leader(self, timeout: float = 30) -> ZookeeperMember:
        give_up = time.monotonic() + timeout
        while True:
            for m in self.members:
                if m.process is not None and m.mode() in ("leader", "standalone"):
                    return m
            if time.monotonic() > give_up:
                raise RuntimeError(f"no zookeeper leader within {timeout}s")
            time.sleep(0.05)  # polling for readiness, not a guess

    def rejoin(self, member: ZookeeperMember) -> None:
        """Start a killed member and wait until it serves in the quorum again."""
        member.start()
        self.wait_serving()

    def restart(self, member: ZookeeperMember) -> None:
        member.kill()
        self.rejoin(member)

    def stop(self) -> None:
        for member in self.members:
            member.kill()


# -- PostgreSQL -------------------------------------------------------------------------
