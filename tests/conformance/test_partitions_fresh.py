"""Partitions with the documented defaults on a freshly started Redis (its restart grace
holds every grant back for about the ttl asked for: joining waits it out, it does not fail)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import asynclock

pytestmark = pytest.mark.anyio


async def test_documented_defaults_on_a_freshly_started_redis(redis_factory: Any) -> None:
    server = redis_factory(fresh=True)
    async with asynclock.connect(server.url) as backend:
        with anyio.fail_after(20):
            async with backend.partitions("orders", count=4, ttl=5) as member:
                while len(member.owned()) < 4:
                    async for owned in member.changes():
                        if len(owned) == 4:
                            break
                tokens = [p.token for p in member.owned()]
                assert [p.id for p in member.owned()] == [0, 1, 2, 3] and min(tokens) > 0
