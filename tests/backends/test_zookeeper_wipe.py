"""A ZooKeeper ensemble that loses its data (issue 39 item 2): the wipe marker, tokens on
its base, and the restart grace. A server stopped, its data directory wiped and started
again on the same port: the old holder is cancelled before anyone is granted the name, and
the new holder's token is above the old one's, although czxids start again near 0."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.backends.zookeeper._era import MARKER
from asynclock.backends.zookeeper._paths import lock_path, reserved_path
from tests.backends.test_zookeeper import eventually, in_thread, kazoo, zk_driver
from tests.support.zk_servers import ZkEnsemble, ZkFactory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def marker_stat(ensemble: ZkEnsemble) -> Any:
    async with kazoo(ensemble.hosts) as raw:
        _, stat = await in_thread(raw.get, MARKER)
        return stat


async def test_a_wiped_server_cancels_the_old_holder_before_a_new_grant(
    zk_factory: ZkFactory, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    ensemble = zk_factory(1)
    member = ensemble.nodes[0]
    ttl = 12.0  # also the new backend's restart grace (the default: its first ttl)
    lost: list[tuple[float, str]] = []

    async def hold(old: asynclock.Backend, *, task_status: Any) -> None:
        with pytest.raises(asynclock.LeaseLost):
            async with old.lock(lock_name, ttl=ttl) as lease:
                task_status.started(lease)
                await anyio.sleep_forever()

    async def seen_lost(lease: asynclock.Lease) -> None:
        # When the loss is signalled (the body cancelled), not when the block is left:
        # its release may take its own timeout against a server that is not back yet.
        reason = await lease.lost.wait()
        lost.append((time.monotonic(), reason))

    caplog.set_level(logging.WARNING, "asynclock.zookeeper")
    # A session longer than the ttl: the server's refusal ends it, or the ttl (a JVM slow
    # to start). kazoo waits up to a session timeout for the answer to a session request
    # (a server that took the connection while starting may never answer it): 15 s.
    async with asynclock.connect(ensemble.url + "?session_timeout=15") as old:
        before = zk_driver(old).eras.era
        assert before is not None
        async with anyio.create_task_group() as tg:
            lease = await tg.start(hold, old)
            tg.start_soon(seen_lost, lease)
            await in_thread(member.kill)
            await in_thread(member.wipe)
            await in_thread(ensemble.rejoin, member)  # the same port, no data
            async with asynclock.connect(ensemble.url) as new:  # the documented defaults
                with anyio.fail_after(60):
                    async with new.lock(lock_name, ttl=ttl, timeout=50) as successor:
                        granted_at = time.monotonic()
                        assert lost, "granted while the old holder still runs"
                        assert lost[0][0] < granted_at
                        assert successor.token > lease.token, (successor.token, lease.token)

        # The old backend comes back on a new session, reads the new marker, says so. The
        # same czxid, likely (the marker is the wiped server's first node): a new ctime.
        def new_era() -> bool:
            era = zk_driver(old).eras.era
            return era is not None and era.ctime_ms > before.ctime_ms

        await eventually(new_era, timeout=60)
        await eventually(lambda: "lost its data" in caplog.text)
        with anyio.fail_after(30):
            async with old.lock(lock_name, ttl=5.0, timeout=25) as again:
                assert again.token > successor.token
        reason = lost[0][1]
        # Cancelled by the server's refusal of the old session (fast restart), or by the
        # local ttl deadline first (a JVM slower to start than the ttl): never later.
        ends = ("wiped or restored", "local deadline passed", "connection to ZooKeeper lost")
        assert any(end in reason for end in ends), reason


async def test_a_fresh_ensemble_waits_the_grace_with_the_documented_defaults(
    zk_factory: ZkFactory, lock_name: str
) -> None:
    ensemble = zk_factory(1, fresh=True)
    ttl = 3.0
    async with asynclock.connect(ensemble.url) as backend:
        created = (await marker_stat(ensemble)).ctime / 1000
        with pytest.raises(asynclock.RestartGrace) as info:
            async with backend.lock(lock_name, ttl=ttl, blocking=False):
                pytest.fail("granted in the restart grace")
        assert info.value.until == pytest.approx(created + ttl, abs=0.01)
        with anyio.fail_after(20):
            async with backend.lock(lock_name, ttl=ttl, timeout=15) as lease:
                assert time.time() >= created + ttl
                assert lease.token >= int(created * 1000) * 1000
    # restart_grace=0: no wait, on a marker just as new.
    other = zk_factory(1, fresh=True)
    async with asynclock.connect(other.url + "?restart_grace=0") as backend:
        async with backend.lock(lock_name, ttl=ttl, blocking=False):
            pass
    with pytest.raises(ValueError, match="restart_grace must be a finite number"):
        asynclock.connect(other.url + "?restart_grace=-1")
    with pytest.raises(ValueError, match="restart_grace must be a number of seconds"):
        asynclock.connect(other.url, restart_grace="soon")


async def test_every_token_is_on_the_markers_base(zk_ensemble: ZkEnsemble, lock_name: str) -> None:
    """Locks, validate(), holder(), permits and read-write epochs: base + (czxid - the
    marker's czxid), one function for all."""
    mark = await marker_stat(zk_ensemble)
    base, first = int(mark.ctime) * 1000, int(mark.czxid)

    def token_of(zxid: int) -> int:
        return base + zxid - first

    async with asynclock.connect(zk_ensemble.url) as backend, kazoo(zk_ensemble.hosts) as raw:
        with anyio.fail_after(20):
            async with backend.lock(lock_name, ttl=5.0) as lease:
                path = lock_path("", lock_name)
                child = (await in_thread(raw.get_children, path))[0]
                _, stat = await in_thread(raw.get, f"{path}/{child}")
                assert lease.token == token_of(stat.czxid) > base
                holder = await backend.holder(lock_name)
                assert holder is not None and holder.token == lease.token
                assert await backend.validate(lock_name, lease.token)
                assert not await backend.validate(lock_name, stat.czxid)  # a raw czxid
            async with backend.semaphore(lock_name, 2).acquire(ttl=5.0) as permit:
                p = reserved_path("", "sem", lock_name) + f"/p/{permit.slot}"
                _, stat = await in_thread(raw.get, p)
                assert permit.token == token_of(stat.czxid)
            rw = backend.rwlock(lock_name)
            async with rw.read(ttl=5.0) as before:
                assert before.token == base  # no writer yet: the era's first token
            async with rw.write(ttl=5.0) as writer:
                _, epoch = await in_thread(raw.get, reserved_path("", "rw", lock_name) + "/e")
                assert writer.token == token_of(epoch.mzxid) > lease.token
            async with rw.read(ttl=5.0) as reader:
                assert reader.token == writer.token
            async with backend.lock(lock_name, ttl=5.0) as later:
                assert later.token > writer.token


def test_no_name_maps_to_the_marker() -> None:
    """``%2E`` is written only as a whole segment (``.``): the marker's segment is no
    lock's, semaphore's or read-write lock's, whatever the name."""
    segment = MARKER[1:]
    for name in ("\x00asynclock.%2Ewipe", "\x00asynclock..wipe", "\x00asynclock.", "."):
        assert lock_path("", name) != MARKER
        for kind in ("sem", "rw"):
            assert not reserved_path("", kind, name).startswith(MARKER + "/")
    assert "/" not in segment and segment.startswith("%00asynclock.")
