"""Checks shared by the conformance suite and backend-specific tests."""

from __future__ import annotations

import asynclock


async def check_max_ttl(backend: asynclock.Backend, name: str) -> None:
    """A lease of ``asynclock.MAX_TTL`` works; ``max_hold`` and ``timeout`` have no bound."""
    lease = await backend.acquire(name, ttl=asynclock.MAX_TTL)
    assert lease.remaining() > asynclock.MAX_TTL * 0.98
    assert await backend.validate(name, lease.token)
    assert await lease.release()
    async with backend.lock(name, ttl=5.0, timeout=1e300, max_hold=1e300) as held:
        assert held.remaining() > 4  # max_hold and timeout are local: no upper bound
