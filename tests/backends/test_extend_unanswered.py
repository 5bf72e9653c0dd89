"""``lease.extend(ttl)`` when the server does not answer (a frozen Redis): the outcome is
unknown, so the caller gets BackendUnavailable and the lease stays safe either way (G3)."""

from __future__ import annotations

import anyio
import pytest

import asynclock
from tests.support.redis_servers import RedisFactory

pytestmark = pytest.mark.anyio


async def test_unanswered_extend_keeps_the_old_ttl_and_a_safe_deadline(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory()
    with anyio.fail_after(30):
        async with asynclock.connect(server.url, socket_timeout=0.3) as backend:
            lease = await backend.acquire("frozen", ttl=10.0)
            before = lease.deadline
            server.freeze()
            try:
                with pytest.raises(
                    asynclock.BackendUnavailable, match="keeps renewing with ttl=10"
                ):
                    await lease.extend(30.0)
                # A longer ttl the server may not have taken: the deadline stays put.
                assert lease.ttl == 10.0 and lease.deadline == before
                with pytest.raises(asynclock.BackendUnavailable, match="to ttl=2s failed"):
                    await lease.extend(2.0)
                # A shorter ttl the server may have taken: the deadline assumes it did.
                assert lease.ttl == 10.0
                assert lease.remaining() <= 2.0
                assert not lease.lost
            finally:
                server.thaw()
            await lease.extend(5.0)  # answered again: applied
            assert lease.ttl == 5.0 and 4.0 < lease.remaining() <= 5.0
            assert await lease.release()
