"""Where a drill runs: the lock servers it was given (``url=``) or started (``spawn=``), and
the store its register lives in.

Also the URL handling the drill needs: the endpoints of a network URL (each one gets its own
partition proxy), and the check that faults only reach loopback hosts unless allowed.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio

from ..backends._common.urls import Host, parse_multi_host_url, url_scheme
from .pg_server import running_pg
from .redis_deploy import ClusterDeployment, SentinelDeployment
from .servers import EtcdMember, EtcdServers, RedisServer
from .zookeeper import ZookeeperServers

#: What ``spawn=`` can start.
SPAWN = (
    "sqlite", "redis", "redlock", "redis-sentinel", "redis-cluster", "postgres",
    "postgres-lease", "etcd", "zookeeper",
)  # fmt: skip

_DEFAULT_PORTS = {
    "redis": 6379,
    "rediss": 6379,
    "redlock": 6379,
    "redis+sentinel": 26379,
    "redis-sentinel": 26379,
    "redis+cluster": 6379,
    "postgresql": 5432,
    "postgres": 5432,
    "etcd": 2379,
    "zookeeper": 2181,
}


def split_url(url: str) -> tuple[str, str, list[tuple[str, int]], str]:
    """(scheme, auth@ or "", [(host, port)...], rest) of a network URL (hosts without
    brackets; no host: the default port on 127.0.0.1)."""
    parts = parse_multi_host_url(url)
    default = _DEFAULT_PORTS.get(parts.scheme, 0)
    endpoints = [(h.host, default if h.port is None else h.port) for h in parts.hosts]
    rest = parts.path + (f"?{parts.query}" if parts.query else "")
    rest += f"#{parts.fragment}" if parts.fragment else ""
    auth = "" if parts.userinfo is None else f"{parts.userinfo}@"
    return parts.scheme, auth, endpoints or [("127.0.0.1", default)], rest


def join_url(scheme: str, auth: str, endpoints: Iterable[tuple[str, int]], rest: str) -> str:
    return f"{scheme}://{auth}" + ",".join(Host(h, p).address() for h, p in endpoints) + rest


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: str, faults: Sequence[str], allow_remote_faults: bool) -> str:
    """The backend kind of ``url``; ValueError if faults would reach a non-loopback host."""
    scheme = url_scheme(url)
    kinds = {
        "sqlite": "sqlite",
        "redis": "redis",
        "rediss": "redis",
        "redlock": "redlock",
        "redis+sentinel": "redis-sentinel",
        "redis-sentinel": "redis-sentinel",
        "redis+cluster": "redis-cluster",
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


#: The session timeout a ``spawn="zookeeper"`` drill's workers ask for, seconds.
ZK_DRILL_SESSION = 2
ZK_COMES_BACK = "with its data (transaction log fsynced) and rejoins the quorum"


@dataclass
class LockServer:
    """A lock server the drill started: the kill fault kill -9s it and starts it again."""

    address: str
    kill: Callable[[], object]
    start: Callable[[], object]
    #: What a restart brings back, for the fault's description.
    comes_back: str
    #: Deletes what it persists (the restart fault restarts it without its data); None:
    #: it persists nothing.
    wipe: Callable[[], object] | None = None


@dataclass
class Deployment:
    kind: str
    url: str
    register: str
    #: Lock servers this drill started, for the kill fault (the register is never on one).
    servers: list[LockServer] = field(default_factory=list)
    #: The failover fault (a replica promoted, the lock name's on a cluster): returns once
    #: the deployment announced it, with what happened; None: this deployment has none.
    failover: Callable[[str], str] | None = None
    #: The failover fault cuts its worker off from the URL's hosts first (the sentinels:
    #: the split brain, a holder still reaching the old primary).
    split: bool = False


def _sentinel_failover(dep: SentinelDeployment, name: str) -> str:
    old = dep.failover()
    new = dep.wait_switched(old)
    return (
        f"SENTINEL FAILOVER: {new} promoted and announced; {old} stays a writable primary "
        "until Sentinel demotes it (~10 s)"
    )


def _cluster_failover(dep: ClusterDeployment, name: str) -> str:
    from ..backends.redis import keys_for
    from ..backends.redis.topology import key_slot

    slot = key_slot(keys_for(name).lock.encode())
    dep.wait_healthy()  # a replica in sync to promote (a node killed before is back)
    primary = dep.owner(slot)
    replica = dep.manual_failover(primary, force=True)
    dep.wait_primary(replica)
    return f"CLUSTER FAILOVER FORCE: {replica.address} took over the slots of {primary.address}"


def _deployments(kind: str, tmp: Path, stack: contextlib.ExitStack, wait: bool) -> Deployment:
    """``redis-sentinel`` (a primary, 2 replicas, 3 sentinels) or ``redis-cluster`` (3+3),
    without persistence; ``wait``: the workers' URL asks for ``wait_replicas=1``."""
    query = "?wait_replicas=1" if wait else ""
    if kind == "redis-sentinel":
        # Two replicas: after a failover WAIT 1 needs one besides the promoted one.
        sentinels = SentinelDeployment(tmp / "sentinel", replicas=2).start()
        stack.callback(sentinels.stop)
        down: list[RedisServer] = []

        def kill() -> None:
            down.append(sentinels.primary())
            down[-1].kill()

        def start() -> None:
            down.pop().start(settle=False)

        comes_back = (
            "empty (no persistence; Sentinel fails over if it stays down past "
            "down-after-milliseconds, 1 s)"
        )
        primary = LockServer("primary", kill, start, comes_back)
        return Deployment(
            kind,
            sentinels.url + query,
            "",
            [primary],
            partial(_sentinel_failover, sentinels),
            split=True,
        )
    cluster = ClusterDeployment(tmp / "cluster").start()
    stack.callback(cluster.stop)
    # A killed primary stays down until the next server kill: its replica takes over.
    nodes = [
        LockServer(n.address, n.kill, partial(n.start, settle=False), "as a replica, empty")
        for n in cluster.primary_nodes()
    ]
    return Deployment(kind, cluster.url + query, "", nodes, partial(_cluster_failover, cluster))


@contextlib.contextmanager
def spawned(kind: str, tmp: Path, run_id: str, wait: bool = True) -> Iterator[Deployment]:
    """Throwaway servers for ``spawn=kind``, configured as the backend's docs recommend, and
    the register on a server of its own: the lock servers can then be killed -9 with the
    fenced resource (and its high-water mark) still up, as in production."""
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            locks = f"sqlite:///{tmp / 'locks.db'}"
            yield Deployment(kind, locks, f"sqlite:{tmp / 'register.db'}#drill")
            return
        if kind in ("postgres", "postgres-lease"):
            # The locks on PostgreSQL's own fsync and commit settings (not the fast test
            # ones): a kill -9 is a crash, and the restart runs crash recovery.
            pg = stack.enter_context(running_pg("asynclock-drill-pg-", durable=True))
            fenced = stack.enter_context(running_pg("asynclock-drill-register-"))
            url = pg.url() + ("?mode=lease" if kind == "postgres-lease" else "")
            server = LockServer(f"127.0.0.1:{pg.port}", pg.kill, pg.start, "after crash recovery")
            yield Deployment("postgres", url, f"{fenced.url()}#drill-{run_id}", [server])
            return
        if kind == "etcd":
            cluster = EtcdServers(tmp / "etcd", 3).start()
            stack.callback(cluster.stop)

            def rejoin(member: EtcdMember) -> None:
                member.start()
                cluster.wait_healthy()  # back in the cluster before the next node is killed

            nodes = [
                LockServer(m.address, m.kill, partial(rejoin, m), "with its data (its WAL)")
                for m in cluster.members
            ]
            yield Deployment(kind, cluster.url, f"sqlite:{tmp / 'register.db'}#drill", nodes)
            return
        if kind == "zookeeper":
            # fsync on (ZooKeeper's default). A killed member rejoins the quorum before the
            # next one is killed, so two of three always serve.
            ensemble = ZookeeperServers(tmp / "zookeeper", 3, durable=True).start()
            stack.callback(ensemble.stop)
            members = [
                LockServer(m.address, m.kill, partial(ensemble.rejoin, m), ZK_COMES_BACK)
                for m in ensemble.members
            ]
            # A killed (or frozen) holder's node lasts until its session expires: ask for
            # 2 s sessions, not the default 10 s, so the drill's successors get their turn.
            url = f"{ensemble.url}?session_timeout={ZK_DRILL_SESSION}"
            yield Deployment(kind, url, f"sqlite:{tmp / 'register.db'}#drill", members)
            return
        store = RedisServer(tmp / "register").start()
        stack.callback(store.stop)
        register = f"{store.url}#asynclock-drill:{run_id}"
        if kind == "redis":
            # AOF with appendfsync always (docs/backends/redis.md): a restart keeps the
            # keys, the fence counters and the epoch key.
            lone = RedisServer(tmp / "redis", persist=True).start()
            stack.callback(lone.stop)
            again = partial(lone.start, settle=False)
            server = LockServer(
                lone.address, lone.kill, again, "from its AOF (appendfsync always)", lone.wipe
            )
            yield Deployment(kind, lone.url, register, [server])
            return
        if kind in ("redis-sentinel", "redis-cluster"):
            dep = _deployments(kind, tmp, stack, wait)
            dep.register = register
            yield dep
            return
        # Redlock nodes without persistence, as its docs allow: a restarted node comes back
        # empty, reseeds its counters from TIME and grants nothing for the restart grace.
        nodes = []
        for i in range(3):
            node = RedisServer(tmp / f"redis{i}").start()
            stack.callback(node.stop)
            again = partial(node.start, settle=False)
            nodes.append(LockServer(node.address, node.kill, again, "empty (no persistence)"))
        url = "redlock://" + ",".join(n.address for n in nodes)
        yield Deployment(kind, url, register, nodes)


def register_for(kind: str, url: str, tmp: Path, run_id: str) -> str:
    if kind not in ("redis", "redlock", "postgres"):
        return f"sqlite:{tmp / 'register.db'}#drill-{run_id}"
    if kind in ("redis", "redlock"):
        _scheme, auth, endpoints, rest = split_url(url)
        host, port = endpoints[0]
        db = rest if kind == "redis" else ""
        address = Host(host, port).address()
        return f"redis://{auth}{address}{db.partition('?')[0]}#asynclock-drill:{run_id}"
    return f"{url}#drill-{run_id}"


@contextlib.asynccontextmanager
async def deployment(
    url: str | None,
    spawn: str | None,
    faults: Sequence[str],
    allow_remote_faults: bool,
    tmp: Path,
    run_id: str,
    wait: bool = True,
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
        dep = await anyio.to_thread.run_sync(stack.enter_context, spawned(spawn, tmp, run_id, wait))
        try:
            yield dep
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)
        return
    assert url is not None
    kind = check_url(url, faults, allow_remote_faults)
    yield Deployment(kind, url, register_for(kind, url, tmp, run_id))
