"""``redis+cluster://`` (issue 41): routing by slot, renewals batched per node, MOVED during
a held lease, a slot migration half done (ASK), a primary killed and a manual failover, WAIT
on the slot owner's connection, and bad URLs."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import pytest
import redis

import asynclock
from asynclock._harness.redis_deploy import ClusterDeployment
from asynclock.backends.redis import ClusterDriver, NotReplicated, keys_for
from asynclock.backends.redis.topology import key_slot, slot_tag
from asynclock.testing import next_renewal_round
from tests.support.redis_servers import DeploymentFactory, RedisServer

pytestmark = pytest.mark.anyio


def _slot(name: str) -> int:
    return key_slot(keys_for(name).lock.encode())


def _names_on(dep: ClusterDeployment, count: int) -> dict[str, list[str]]:
    """``count`` names per primary (address -> names)."""
    out: dict[str, list[str]] = {n.address: [] for n in dep.primary_nodes()}
    i = 0
    while any(len(v) < count for v in out.values()):
        name = f"n{i}"
        i += 1
        owner = dep.owner(_slot(name)).address
        if len(out[owner]) < count:
            out[owner].append(name)
    return out


def _evalsha_calls(port: int) -> int:
    client = redis.Redis(port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_slot_tags_hit_every_slot() -> None:
    """The epoch key of each slot is in that slot (tags solved, not searched)."""
    assert all(key_slot(f"x{{{slot_tag(s)}}}".encode()) == s for s in range(16384))
    assert all("{" not in slot_tag(s) and "}" not in slot_tag(s) for s in range(0, 16384, 97))


async def test_defaults_and_one_renewal_script_per_node(
    redis_cluster_deployment: ClusterDeployment,
) -> None:
    """Defaults on a freshly started cluster (no WAIT); 30 leases on 3 primaries are renewed
    with one script per node per round."""
    dep = redis_cluster_deployment
    spread = _names_on(dep, 10)
    async with asynclock.connect(dep.url) as backend:
        driver = backend.driver
        assert isinstance(driver, ClusterDriver) and driver.wait is None
        assert len(driver.primaries()) == 3
        async with contextlib.AsyncExitStack() as stack:
            for names in spread.values():
                for name in names:
                    await stack.enter_async_context(backend.lock(name, ttl=3.0))
            with anyio.fail_after(10):
                await next_renewal_round(backend)
                before = {a: _evalsha_calls(int(a.rsplit(":", 1)[1])) for a in spread}
                await next_renewal_round(backend)
                after = {a: _evalsha_calls(int(a.rsplit(":", 1)[1])) for a in spread}
            assert {a: after[a] - before[a] for a in spread} == dict.fromkeys(spread, 1)
            assert backend.stats().losses == 0


def _elsewhere(dep: ClusterDeployment, slot: int) -> tuple[RedisServer, RedisServer]:
    """The primary of ``slot``, and another one to move it to."""
    source = dep.owner(slot)
    return source, next(n for n in dep.primary_nodes() if n is not source)


async def _rounds(backend: asynclock.Backend, count: int = 4) -> None:
    with anyio.fail_after(10):
        for _ in range(count):
            await next_renewal_round(backend)


async def test_moved_during_a_held_lease_keeps_it(deployment_factory: DeploymentFactory) -> None:
    """The slot of a held name moves to another primary (keys and all): the next renewal
    finds the key on another node, follows the slot there and keeps renewing; release and
    the next acquire go to the new owner."""
    dep = deployment_factory.cluster()
    name, slot = "moving", _slot("moving")
    async with asynclock.connect(dep.url) as backend:
        async with backend.lock(name, ttl=1.0) as lease:
            _, target = _elsewhere(dep, slot)
            await anyio.to_thread.run_sync(dep.migrate, slot, target)
            await _rounds(backend)  # past its ttl: renewed on the new owner
            assert not lease.lost
            assert await backend.validate(name, lease.token)
            token = lease.token
        assert backend.stats().losses == 0
        async with backend.lock(name, ttl=1.0, blocking=False) as again:
            assert again.token > token
    assert dep.owner(slot) is target


async def test_a_slot_migration_half_done(deployment_factory: DeploymentFactory) -> None:
    """The slot is migrating and the lock key already moved (the rest not yet): renewal
    and validation reach it on the target (ASK, then ASKING on one connection); once the
    migration ends, release finds it there."""
    dep = deployment_factory.cluster()
    name = "half"
    slot = _slot(name)
    async with asynclock.connect(dep.url) as backend:
        async with backend.lock(name, ttl=1.0) as lease:
            source, target = _elsewhere(dep, slot)
            await anyio.to_thread.run_sync(dep.begin_migration, slot, target)
            lock = keys_for(name).lock.encode()
            await anyio.to_thread.run_sync(dep.move_keys, slot, source, target, [lock])
            await _rounds(backend)
            assert not lease.lost
            assert await backend.validate(name, lease.token)
            await anyio.to_thread.run_sync(dep.move_keys, slot, source, target, None)
            await anyio.to_thread.run_sync(dep.end_migration, slot, target)
        assert backend.stats().losses == 0
        assert not await backend.locked(name)  # released on the target
        async with backend.lock(name, ttl=1.0, blocking=False) as again:
            assert again.token > lease.token


async def _hold_and_grab(
    dep: ClusterDeployment, names: list[str], fault: Any, ttl: float = 2.0
) -> tuple[dict[str, asynclock.Lease], dict[str, tuple[bool, int]]]:
    """A holds ``names``; ``fault()`` runs; B acquires each, noting whether A still
    believed it held the name at that moment."""
    leases: dict[str, asynclock.Lease] = {}
    seen: dict[str, tuple[bool, int]] = {}
    held, stop = anyio.Event(), anyio.Event()
    async with asynclock.connect(dep.url) as a, asynclock.connect(dep.url) as b:

        async def hold(name: str) -> None:
            with contextlib.suppress(asynclock.LeaseLost):
                async with a.lock(name, ttl=ttl) as lease:
                    leases[name] = lease
                    if len(leases) == len(names):
                        held.set()
                    await stop.wait()

        async def grab(name: str) -> None:
            with anyio.fail_after(40):
                while True:  # as an application would: its primary may be down a while
                    try:
                        async with b.lock(name, ttl=1.0, timeout=40) as lease:
                            old = leases[name]
                            seen[name] = (not old.lost and old.remaining() > 0, lease.token)
                            return
                    except asynclock.BackendUnavailable:
                        await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(hold, name)
            await held.wait()
            await anyio.to_thread.run_sync(fault)
            async with anyio.create_task_group() as grabs:
                for name in names:
                    grabs.start_soon(grab, name)
            stop.set()
    return leases, seen


@pytest.mark.timeout(120)
async def test_a_killed_primary(deployment_factory: DeploymentFactory) -> None:
    """kill -9 a primary with leases on it: they are lost (the replica that takes its slots
    grants only after them, with larger tokens); the leases on the other primaries live."""
    dep = deployment_factory.cluster()
    spread = _names_on(dep, 3)
    victim = dep.primary_nodes()[0]
    doomed = spread[victim.address]
    others = [n for address, names in spread.items() if address != victim.address for n in names]
    async with asynclock.connect(dep.url) as c:
        # While a primary is down and not yet replaced, the whole cluster answers
        # CLUSTERDOWN (cluster-require-full-coverage, the default): the other primaries'
        # leases live through it only if their ttl outlasts the failover (under CI load it
        # took longer than a 2 s ttl's margin and they were lost, as documented).
        survivors = [await c.acquire(name, ttl=10.0) for name in others]
        t0 = time.monotonic()
        leases, seen = await _hold_and_grab(dep, doomed, victim.kill)
        assert time.monotonic() - t0 > 1.0  # the failover took its time
        assert not [n for n, (believed, _) in seen.items() if believed], "double grants"
        assert all(seen[n][1] > leases[n].token for n in doomed)
        assert all(lease.lost for lease in leases.values())
        assert not [lease for lease in survivors if lease.lost]
        for lease in survivors:
            await lease.release()


async def test_a_manual_failover(deployment_factory: DeploymentFactory) -> None:
    """CLUSTER FAILOVER on a replica: the old primary's leases are lost with the failover
    as their reason, before its successor grants the names."""
    dep = deployment_factory.cluster()
    victim = dep.primary_nodes()[1]
    names = _names_on(dep, 3)[victim.address]

    def fail_over() -> None:
        dep.wait_primary(dep.manual_failover(victim))

    leases, seen = await _hold_and_grab(dep, names, fail_over, ttl=5.0)
    assert not [n for n, (believed, _) in seen.items() if believed], "double grants"
    for name, lease in leases.items():
        assert lease.lost.reason is not None and "failover" in lease.lost.reason
        assert seen[name][1] > lease.token


async def test_wait_on_the_slot_owner(redis_cluster_deployment: ClusterDeployment) -> None:
    """WAIT goes to the connection of the slot's primary, after its script: one replica
    each confirms; two cannot, and the error says what to change."""
    url = redis_cluster_deployment.url
    async with asynclock.connect(url, wait_replicas=1) as backend:
        for i in range(6):  # names on every primary
            async with backend.lock(f"w{i}", ttl=1.0) as lease:
                assert lease.token > 0
    async with asynclock.connect(url, wait_replicas=2, wait_timeout=0.1) as backend:
        with pytest.raises(NotReplicated, match="reached 1 of the 2 replica"):
            async with backend.lock("w0", ttl=1.0):
                pass
        assert not await backend.locked("w0")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+cluster://", "at least one cluster node"),
        ("redis+cluster://h:1/2", "no database number but 0"),
        ("rediss+cluster://h:1", "TLS is not supported"),
        ("redis+cluster://h:1?ssl_certfile=/c.pem", "TLS is not supported"),
        ("redis+cluster://h:1?sentinel_password=x", "unknown redis+cluster:// URL option"),
    ],
)
def test_bad_urls(url: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        asynclock.connect(url.replace("://", "://u:s3cret@", 1))
    assert words in str(caught.value)
    assert "s3cret" not in str(caught.value)


async def test_unreachable_cluster_says_so(redis_cluster_deployment: ClusterDeployment) -> None:
    with pytest.raises(asynclock.BackendUnavailable, match="no cluster node answered"):
        async with asynclock.connect("redis+cluster://:pw-9@127.0.0.1:1", connect_timeout=0.2):
            pass
