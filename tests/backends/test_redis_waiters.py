"""Redis's fair queue when a waiter gives up at the worst moment (issue 21 item 4)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

import asynclock
from asynclock._harness.proxy import Proxy
from asynclock.backends.redis import keys_for
from tests.support.redis_servers import RedisFactory, wait_until

pytestmark = pytest.mark.anyio


async def _lock(backend: asynclock.Backend, name: str) -> None:
    async with backend.lock(name, ttl=10.0):
        pytest.fail("the waiter was granted the lock")


async def _campaign(backend: asynclock.Backend, name: str) -> None:
    async with backend.leadership(name, ttl=10.0):
        pytest.fail("the campaign was elected")


@pytest.mark.parametrize("wait", [_lock, _campaign], ids=["lock", "leadership"])
async def test_a_waiter_cancelled_while_its_first_attempt_is_in_flight_leaves_no_ghost(
    redis_factory: RedisFactory,
    wait: Callable[[asynclock.Backend, str], Awaitable[None]],
) -> None:
    """Before the fix: the server queued the waiter, its reply was still on the way when
    the waiter was cancelled, and its backend did not know it had joined, so it never left
    the queue. The holder's release then handed the name to the gone waiter: nobody held
    it, yet every acquire got LockHeld for the ghost's ttl (8 of 8 tries)."""
    import redis.asyncio

    server = redis_factory()
    proxy = Proxy(("127.0.0.1", server.port))
    client = redis.asyncio.Redis.from_url(server.url)
    queue = keys_for("ghost").queue
    try:
        async with (
            anyio.create_task_group() as tg,
            asynclock.connect(server.url) as holder,
        ):
            await tg.start(proxy.serve)
            async with asynclock.connect(f"redis://{proxy.address}/0") as waiter:
                assert not await waiter.locked("warm-up")  # its connection is up
                lease = await holder.acquire("ghost", ttl=10.0)
                proxy.set_mode("latency", 0.5)  # every reply reaches the waiter 0.5 s late
                cancel = anyio.CancelScope()
                gone = anyio.Event()

                async def waiting() -> None:
                    try:
                        with cancel:
                            await wait(waiter, "ghost")
                    finally:
                        gone.set()

                tg.start_soon(waiting)
                # The server has queued it; its answer is still held at the proxy.
                await wait_until(lambda: _queued(client, queue), timeout=5)
                cancel.cancel()
                proxy.heal()
                with anyio.fail_after(10):
                    await gone.wait()
                await lease.release()
                # Nobody waits any more: the name is free for anyone at once.
                async with holder.lock("ghost", ttl=5.0, blocking=False) as again:
                    assert again.token > lease.token
                assert await client.zcard(queue) == 0
            tg.cancel_scope.cancel()
    finally:
        await client.aclose()


async def _queued(client: object, queue: str) -> bool:
    import redis.asyncio

    assert isinstance(client, redis.asyncio.Redis)
    return int(await client.zcard(queue)) >= 1
