"""``redis+sentinel://`` (issue 41): the documented defaults on a freshly started deployment,
a ``SENTINEL FAILOVER`` while locks are held, ``wait_replicas``, and bad URLs.

The failover trials share one failover each: every trial is a lock name (cheap: one
deployment, one failover, 50 names). A *double grant* is a name granted by the new primary
while its holder on the old one still believed it held it (its lease not lost, its local
deadline not passed), checked at the moment of the new grant.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock._harness.proxy import Proxy
from asynclock._harness.redis_deploy import SentinelDeployment
from asynclock.backends.redis import NotReplicated, SentinelDriver
from tests.support.redis_servers import DeploymentFactory

pytestmark = pytest.mark.anyio


async def test_defaults_on_a_fresh_deployment(deployment_factory: DeploymentFactory) -> None:
    """Defaults: no WAIT, the restart grace, a display without the password."""
    dep = deployment_factory.sentinel()
    async with asynclock.connect(dep.url) as backend:
        driver = backend.driver
        assert isinstance(driver, SentinelDriver)
        assert driver.wait is None  # wait_replicas defaults to 0
        assert driver.current.address == dep.primary_address()
        async with backend.lock("fresh", ttl=1.0) as lease:
            assert await backend.validate("fresh", lease.token)
            assert (await backend.holder("fresh")) is not None
        assert not await backend.locked("fresh")


async def test_lettuce_form_and_a_database(redis_sentinel_deployment: SentinelDeployment) -> None:
    """``redis-sentinel://host:port/<db>#<service>`` (Lettuce's form) reaches the same
    primary; the lock keys go to that database."""
    hosts = redis_sentinel_deployment.url.split("//")[1].split("/")[0]
    url = f"redis-sentinel://{hosts}/3#{redis_sentinel_deployment.service}"
    async with asynclock.connect(url) as backend:
        async with backend.lock("db3", ttl=1.0):
            client = redis.asyncio.Redis(port=redis_sentinel_deployment.primary().port, db=3)
            try:
                assert await client.exists(b"asynclock:{db3}") == 1
            finally:
                await client.aclose()


class Holders:
    """Leases one backend holds, one task each, until told to stop (or lost)."""

    def __init__(self, backend: asynclock.Backend, names: list[str], ttl: float) -> None:
        self.backend, self.names, self.ttl = backend, names, ttl
        self.leases: dict[str, asynclock.Lease] = {}
        self.all_held = anyio.Event()
        self.stop = anyio.Event()

    async def hold(self, name: str) -> None:
        with contextlib.suppress(asynclock.LeaseLost):
            async with self.backend.lock(name, ttl=self.ttl) as lease:
                self.leases[name] = lease
                if len(self.leases) == len(self.names):
                    self.all_held.set()
                await self.stop.wait()

    def believes(self, name: str) -> bool:
        """Its holder still believes it holds ``name`` (not lost, deadline not passed)."""
        lease = self.leases[name]
        return not lease.lost and lease.remaining() > 0


async def _grab_all(backend: asynclock.Backend, holders: Holders, ttl: float) -> dict[str, Any]:
    """Acquire every name of ``holders`` from ``backend`` (waiting); per name, whether its
    old holder still believed it held it at the moment of the grant, and the token."""
    seen: dict[str, Any] = {}

    async def grab(name: str) -> None:
        async with backend.lock(name, ttl=ttl, timeout=30) as lease:
            seen[name] = (holders.believes(name), lease.token)

    async with anyio.create_task_group() as tg:
        for name in holders.names:
            tg.start_soon(grab, name)
    return seen


async def test_failover_loses_every_lease_before_the_new_primary_grants(
    deployment_factory: DeploymentFactory,
) -> None:
    """SENTINEL FAILOVER with locks held: each holder loses its lease at the announcement
    (not at its deadline: the old primary stays writable for ~10 s and would keep renewing
    it), before the new primary grants the name to anyone, and the new tokens are above the
    old ones (the failover's token floor)."""
    dep = deployment_factory.sentinel()
    names = [f"f{i}" for i in range(10)]
    async with asynclock.connect(dep.url) as a, asynclock.connect(dep.url) as b:
        holders = Holders(a, names, ttl=5.0)
        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(holders.hold, name)
            await holders.all_held.wait()
            t0 = time.monotonic()
            old = await anyio.to_thread.run_sync(dep.failover)
            seen = await _grab_all(b, holders, ttl=1.0)
            holders.stop.set()
        elapsed = time.monotonic() - t0
    assert seen.keys() == set(names)
    assert not [n for n, (believed, _) in seen.items() if believed], "double grants"
    for name, lease in holders.leases.items():
        assert lease.lost.reason is not None and "failover" in lease.lost.reason, lease.lost.reason
        assert old in lease.lost.reason
        assert seen[name][1] > lease.token
    assert elapsed < 5.0  # at the announcement, well before the 5 s leases would have ended


@contextlib.asynccontextmanager
async def _behind_proxies(dep: SentinelDeployment) -> AsyncIterator[tuple[str, list[Proxy]]]:
    """A URL that reaches the sentinels through proxies (that can go dark), and those."""
    ports = [int(p.rsplit(":", 1)[1]) for p in dep.url.split("//")[1].split("/")[0].split(",")]
    proxies = [Proxy(("127.0.0.1", port)) for port in ports]
    async with anyio.create_task_group() as tg:
        for proxy in proxies:
            await tg.start(proxy.serve)
        yield f"redis+sentinel://{','.join(p.address for p in proxies)}/{dep.service}", proxies
        for proxy in proxies:
            proxy.heal()
        tg.cancel_scope.cancel()


async def _split_brain(
    dep: SentinelDeployment, names: list[str], **options: Any
) -> tuple[Holders, dict[str, Any]]:
    """A holds ``names`` through proxies to the sentinels; the proxies go dark (A no longer
    hears of a failover, but still reaches the old primary), SENTINEL FAILOVER, and B (who
    hears it) acquires every name from the new primary."""
    async with _behind_proxies(dep) as (hidden, proxies):
        async with (
            asynclock.connect(hidden, **options) as a,
            asynclock.connect(dep.url, **options) as b,
        ):
            holders = Holders(a, names, ttl=1.0)
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(holders.hold, name)
                await holders.all_held.wait()
                for proxy in proxies:
                    proxy.set_mode("blackhole")
                await anyio.to_thread.run_sync(dep.failover)
                seen = await _grab_all(b, holders, ttl=1.0)
                holders.stop.set()
    return holders, seen


@pytest.mark.timeout(120)
async def test_with_wait_no_double_grant_in_50_trials(
    deployment_factory: DeploymentFactory,
) -> None:
    """The split brain: a holder cut off from the sentinels keeps talking to the old
    primary, which stays a writable master after the failover. With ``wait_replicas=1`` its
    renewals there count only once the (now promoted) replica has them, so they stop
    counting at the promotion and it loses each lease at its deadline, before the new
    primary grants the name: 0 double grants in 50 names. Without WAIT (the second run,
    the control) the same trial has the old holder renewing on the old primary while the
    new one grants: double grants, which is what this test would see if WAIT were ignored."""
    names = [f"t{i}" for i in range(50)]
    # Two replicas: after the failover the new primary needs one besides itself to confirm
    # (with one, its grants would wait for the old primary to rejoin as a replica).
    dep = deployment_factory.sentinel(replicas=2)
    holders, seen = await _split_brain(dep, names, wait_replicas=1)
    assert seen.keys() == set(names)
    doubles = [n for n, (believed, _) in seen.items() if believed]
    assert doubles == [], f"{len(doubles)} double grants of 50"
    assert all(lease.lost for lease in holders.leases.values())
    # The control: the same trial without WAIT grants twice.
    dep = deployment_factory.sentinel(replicas=2)
    holders, seen = await _split_brain(dep, names)
    doubles = [n for n, (believed, _) in seen.items() if believed]
    assert len(doubles) >= 1, "without WAIT the split brain should show a double grant"
    # The fence still orders them: every new token is above every old one.
    assert min(t for _, t in seen.values()) > max(x.token for x in holders.leases.values())


async def test_tokens_jump_over_the_old_primary_even_if_its_data_was_never_adopted(
    deployment_factory: DeploymentFactory,
) -> None:
    """The new primary hands out tokens above every token the old one handed out, also the
    ones it handed out after the promotion to a holder cut off from the sentinels (the split
    brain, no WAIT), and also when no backend had adopted the old primary's data yet (no era
    key: it is a promoted replica all the same). Before: the new primary counted on from the
    replicated counter and handed out the very token the old primary had just given."""
    dep = deployment_factory.sentinel(replicas=2)
    async with _behind_proxies(dep) as (hidden, proxies):
        async with asynclock.connect(hidden) as a, asynclock.connect(dep.url) as b:
            async with a.lock("jump", ttl=1.0) as before:
                pass
            client = redis.asyncio.Redis(port=dep.primary().port)
            try:
                await client.delete(b"asynclock:era")
                await client.execute_command("WAIT", 2, 5000)  # type: ignore[no-untyped-call]
            finally:
                await client.aclose()
            for proxy in proxies:
                proxy.set_mode("blackhole")
            old = await anyio.to_thread.run_sync(dep.failover)
            await anyio.to_thread.run_sync(dep.wait_switched, old)
            async with a.lock("jump", ttl=1.0) as late:  # on the old primary, still writable
                assert late.token > before.token
            async with b.lock("jump", ttl=1.0, timeout=10) as new:
                assert new.token > late.token


async def test_wait_failure_says_what_to_change(
    redis_sentinel_deployment: SentinelDeployment,
) -> None:
    """wait_replicas above the replicas the primary has: the grant does not count, is
    given back, and the error says what to change (redisson#5702's "None of slaves were
    synced" with the fix in it)."""
    url = redis_sentinel_deployment.url
    async with asynclock.connect(url, wait_replicas=1, wait_timeout=0.5) as backend:
        async with backend.lock("waited", ttl=1.0) as lease:  # one replica: confirmed
            assert lease.token > 0
    async with asynclock.connect(url, wait_replicas=2, wait_timeout=0.1) as backend:
        with pytest.raises(NotReplicated) as caught:
            async with backend.lock("unconfirmed", ttl=1.0):
                pass
        message = str(caught.value)
        assert "reached 1 of the 2 replica(s)" in message
        assert "wait_replicas" in message and "wait_timeout" in message
        assert not await backend.locked("unconfirmed")  # given back


@pytest.mark.parametrize(
    ("url", "error", "words"),
    [
        ("redis+sentinel://127.0.0.1:26379", ValueError, "needs the service (master) name"),
        ("redis+sentinel://127.0.0.1:26379/", ValueError, "needs the service (master) name"),
        ("redis+sentinel:///mymaster", ValueError, "at least one sentinel"),
        ("redis+sentinel://h:26379/m/x", ValueError, "database must be a number"),
        ("rediss+sentinel://h:26379/m", ValueError, "TLS is not supported"),
        ("redis+sentinel://h:26379/m?ssl_ca_certs=/ca.pem", ValueError, "TLS is not supported"),
        ("redis+sentinel://h:26379/m?wait_replicas=-1", ValueError, "wait_replicas must be"),
        ("redis+sentinel://h:26379/m?wait_timeout=0", ValueError, "wait_timeout must be"),
        ("redis+sentinel://h:1,h:1/m", ValueError, "same host twice"),
        ("redis+sentinel://h:1/m?nope=1", ValueError, "unknown redis+sentinel:// URL option"),
    ],
)
def test_bad_urls_are_refused_before_io(url: str, error: type[Exception], words: str) -> None:
    """Each with a password in it: never in the message."""
    with pytest.raises(error) as caught:
        asynclock.connect(url.replace("://", "://u:s3cret@", 1))
    assert words in str(caught.value)
    assert "s3cret" not in str(caught.value)


async def test_unknown_service_is_named_with_what_the_sentinels_monitor(
    redis_sentinel_deployment: SentinelDeployment,
) -> None:
    url = redis_sentinel_deployment.url.rsplit("/", 1)[0] + "/nosuch"
    with pytest.raises(ValueError) as caught:
        async with asynclock.connect(url.replace("//", "//:pw-1@", 1)):
            pass
    message = str(caught.value)
    assert "no sentinel monitors a service named 'nosuch'" in message
    assert repr(redis_sentinel_deployment.service) in message
    assert "pw-1" not in message


async def test_sentinels_with_a_password(deployment_factory: DeploymentFactory) -> None:
    """Sentinels that require a password: without sentinel_password the error says which
    option to set; with a wrong one, no password is in the message; with it, it works."""
    dep = deployment_factory.sentinel(sentinel_password="sentinel-pw", sentinels=1)
    with pytest.raises(asynclock.BackendUnavailable) as caught:
        async with asynclock.connect(dep.url.replace("//", "//:data-pw@", 1)):
            pass
    message = str(caught.value)
    assert "sentinel_password" in message
    assert "data-pw" not in message
    with pytest.raises(asynclock.BackendUnavailable) as caught:
        async with asynclock.connect(dep.url, sentinel_password="wrong-pw"):
            pass
    assert "wrong-pw" not in str(caught.value)
    async with asynclock.connect(dep.url, sentinel_password="sentinel-pw") as backend:
        async with backend.lock("auth", ttl=1.0) as lease:
            assert lease.token > 0
