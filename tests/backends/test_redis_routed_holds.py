"""Semaphores and read-write locks on ``redis+sentinel://`` and ``redis+cluster://`` (issue
42): a failover with permits and a writer held (they are lost at once, with the failover as
their reason, before the new primary grants; no permit beyond the limit in between; the new
tokens and epochs are above the old ones), and a slot that moves under a held permit (kept;
a grant sent to the old owner follows MOVED and grants once)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import pytest
import redis

import asynclock
from asynclock._harness.redis_deploy import SentinelDeployment
from asynclock.backends.redis import NotReplicated
from asynclock.backends.redis.rwlock import rwlock_keys
from asynclock.backends.redis.semaphore import semaphore_keys
from asynclock.backends.redis.topology import key_slot
from asynclock.testing import next_renewal_round
from tests.support.redis_servers import DeploymentFactory

pytestmark = pytest.mark.anyio

LIMIT = 2


class Old:
    """Backend A's holds: ``LIMIT`` permits of "gpu" and the write hold of ``table``, each
    kept (one task each) until lost or told to stop."""

    def __init__(self, backend: asynclock.Backend, ttl: float, table: str) -> None:
        self.backend, self.ttl, self.table = backend, ttl, table
        self.permits: list[asynclock.Permit] = []
        self.writer: Any = None
        self.all_held = anyio.Event()
        self.stop = anyio.Event()

    def _held(self) -> None:
        if len(self.permits) == LIMIT and self.writer is not None:
            self.all_held.set()

    async def permit(self) -> None:
        with contextlib.suppress(asynclock.LeaseLost):
            async with self.backend.semaphore("gpu", LIMIT).acquire(ttl=self.ttl) as permit:
                self.permits.append(permit)
                self._held()
                await self.stop.wait()

    async def write(self) -> None:
        with contextlib.suppress(asynclock.LeaseLost):
            async with self.backend.rwlock(self.table).write(ttl=self.ttl) as hold:
                self.writer = hold
                self._held()
                await self.stop.wait()

    def believed(self) -> int:
        """Permits whose holder still believes it holds them (not lost, deadline ahead)."""
        return sum(1 for p in self.permits if not p.lost and p.remaining() > 0)


async def _fail_over_and_grab(
    url: str, fault: Any, ttl: float, table: str = "table"
) -> tuple[Old, dict[str, Any]]:
    """A holds every permit and the writer; ``fault()`` runs; B takes ``LIMIT`` permits and
    the write hold (retrying while the primary is down, as an application would), noting
    at each grant how many of A's permits A still believed it held."""
    seen: dict[str, Any] = {"permits": [], "writer": None}
    async with asynclock.connect(url) as a, asynclock.connect(url) as b:
        old = Old(a, ttl, table)

        async def grab_permit(stop: anyio.Event, held: list[int]) -> None:
            while True:
                try:
                    sem = b.semaphore("gpu", LIMIT)
                    async with sem.acquire(ttl=1.0, timeout=40) as permit:
                        seen["permits"].append((old.believed(), permit.slot, permit.token))
                        held.append(1)
                        if len(held) == LIMIT:
                            stop.set()
                        await stop.wait()  # both of B's permits at once: the limit is full
                        return
                except asynclock.BackendUnavailable:
                    await anyio.sleep(0.1)

        async def grab_writer() -> None:
            while True:
                try:
                    async with b.rwlock(table).write(ttl=1.0, timeout=40) as hold:
                        seen["writer"] = (old.writer.lost.reason, hold.token)
                        return
                except asynclock.BackendUnavailable:
                    await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            for _ in range(LIMIT):
                tg.start_soon(old.permit)
            tg.start_soon(old.write)
            with anyio.fail_after(20):
                await old.all_held.wait()
            t0 = time.monotonic()
            await anyio.to_thread.run_sync(fault)
            with anyio.fail_after(60):
                async with anyio.create_task_group() as grabs:
                    stop, held = anyio.Event(), list[int]()
                    for _ in range(LIMIT):
                        grabs.start_soon(grab_permit, stop, held)
                    grabs.start_soon(grab_writer)
            seen["elapsed"] = time.monotonic() - t0
            old.stop.set()
    return old, seen


def _check(old: Old, seen: dict[str, Any], where: str) -> None:
    assert len(seen["permits"]) == LIMIT
    assert not [s for s in seen["permits"] if s[0]], "a permit granted beyond the limit"
    old_tokens = {p.slot: p.token for p in old.permits}
    for _, slot, token in seen["permits"]:
        assert token > old_tokens[slot], (slot, token, old_tokens)
    for permit in old.permits:
        reason = permit.lost.reason
        assert reason is not None and "failover" in reason and where in reason, reason
    writer_reason, epoch = seen["writer"]
    assert writer_reason is not None and "failover" in writer_reason, writer_reason
    assert epoch > old.writer.token


@pytest.mark.timeout(120)
async def test_sentinel_failover_loses_permits_and_holds_before_the_new_primary_grants(
    deployment_factory: DeploymentFactory,
) -> None:
    """SENTINEL FAILOVER with every permit of a semaphore and a write hold held: each is lost
    at the announcement (well before its 5 s ttl), before the new primary grants; while it
    grants, A believes none of its permits held (never more than LIMIT); the new slot
    tokens and the new epoch are above the old ones (the failover's token floor)."""
    dep = deployment_factory.sentinel()
    where: list[str] = []

    def fault() -> None:
        where.append(dep.failover())

    old, seen = await _fail_over_and_grab(dep.url, fault, ttl=5.0)
    _check(old, seen, where[0])


@pytest.mark.timeout(120)
async def test_cluster_failover_loses_permits_and_holds_before_the_successor_grants(
    deployment_factory: DeploymentFactory,
) -> None:
    """CLUSTER FAILOVER on the replica of the primary serving "gpu" (and the read-write
    lock, a name in a slot of the same primary): the same."""
    dep = deployment_factory.cluster()
    victim = dep.owner(key_slot(semaphore_keys("gpu", "asynclock:")[0]))
    table = next(
        f"t{i}"
        for i in range(100)
        if dep.owner(key_slot(rwlock_keys(f"t{i}", "asynclock:")[0])).address == victim.address
    )

    def fault() -> None:
        dep.wait_primary(dep.manual_failover(victim))

    old, seen = await _fail_over_and_grab(dep.url, fault, ttl=5.0, table=table)
    _check(old, seen, victim.address)


async def test_a_slot_moved_under_a_held_permit(deployment_factory: DeploymentFactory) -> None:
    """The slot of "gpu" moves (keys and all) while a permit is held: a grant sent at once
    goes to the old owner, follows MOVED and is granted once on the new owner (two live
    permits there, not three); the held permit is renewed there and kept."""
    dep = deployment_factory.cluster()
    set_key = semaphore_keys("gpu", "asynclock:")[0]
    slot = key_slot(set_key)
    async with asynclock.connect(dep.url) as backend:
        sem = backend.semaphore("gpu", 3)
        async with sem.acquire(ttl=1.0) as first:
            source = dep.owner(slot)
            target = next(n for n in dep.primary_nodes() if n is not source)
            await anyio.to_thread.run_sync(dep.migrate, slot, target)
            with anyio.fail_after(10):
                async with sem.acquire(ttl=1.0, blocking=False) as second:
                    client = redis.Redis(port=target.port)
                    try:
                        assert client.zcard(set_key) == 2
                    finally:
                        client.close()
                    assert second.slot != first.slot
                    for _ in range(4):  # past the ttl: renewed on the new owner
                        await next_renewal_round(backend)
                    assert not first.lost and not second.lost
        assert backend.stats().losses == 0
    assert dep.owner(slot) is target


async def test_wait_confirms_permits_and_holds(
    redis_sentinel_deployment: SentinelDeployment,
) -> None:
    """``wait_replicas``: a permit's and a hold's grant and renewals are confirmed by the
    replica; above the replicas there are, the grant does not count (NotReplicated, saying
    what to change) and is given back (the permit is free again)."""
    url = redis_sentinel_deployment.url
    async with asynclock.connect(url, wait_replicas=1, wait_timeout=0.5) as backend:
        with anyio.fail_after(20):
            async with backend.semaphore("waited", 1).acquire(ttl=0.6) as permit:
                async with backend.rwlock("waited").write(ttl=0.6) as hold:
                    for _ in range(4):  # past the ttl: renewed, confirmed
                        await next_renewal_round(backend)
                    assert not permit.lost and not hold.lost
    async with asynclock.connect(url, wait_replicas=2, wait_timeout=0.1) as backend:
        for acquire in (
            lambda: backend.semaphore("unconfirmed", 1).acquire(ttl=1.0, blocking=False),
            lambda: backend.rwlock("unconfirmed").write(ttl=1.0, blocking=False),
        ):
            with pytest.raises(NotReplicated, match="reached 1 of the 2 replica"):
                async with acquire():
                    pytest.fail("an unconfirmed grant counted")
    async with asynclock.connect(url) as backend:
        with anyio.fail_after(10):
            async with backend.semaphore("unconfirmed", 1).acquire(ttl=1.0, blocking=False):
                pass  # given back
            async with backend.rwlock("unconfirmed").write(ttl=1.0, blocking=False):
                pass
