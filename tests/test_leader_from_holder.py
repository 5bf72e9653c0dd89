"""``backend.leader()`` is answered by the driver's one query, ``Driver.holder()``: a driver
implements who-holds-it once, and leader() reads the identity out of the holder's owner."""

from __future__ import annotations

import anyio
import pytest

import asynclock
from asynclock.backends.memory import MemoryDriver

pytestmark = pytest.mark.anyio


class HolderOnly(MemoryDriver):
    """The memory driver, its holder() answers counted; it has no other lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.holder_calls = 0

    async def holder(self, name: str) -> asynclock.Holder | None:
        self.holder_calls += 1
        return await super().holder(name)


class ForeignHolder(MemoryDriver):
    """A server whose key for the name was written by another tool: no token."""

    async def holder(self, name: str) -> asynclock.Holder | None:
        return asynclock.Holder(name, "some-other-tool", None, None)


class NoOwners(MemoryDriver):
    tells_owner = False


async def test_leader_is_read_from_holder() -> None:
    driver = HolderOnly()
    async with asynclock.Backend(driver) as backend:
        with anyio.fail_after(10):
            assert await backend.leader("job") is None
            async with backend.leadership("job", ttl=5.0, identity="node-a") as term:
                assert await backend.leader("job") == asynclock.Leader("node-a", term.token)
    assert driver.holder_calls == 2


async def test_a_holder_without_a_token_is_no_leader() -> None:
    async with asynclock.Backend(ForeignHolder()) as backend:
        assert await backend.leader("job") is None


async def test_a_driver_that_cannot_tell_owners_refuses_leader() -> None:
    async with asynclock.Backend(NoOwners()) as backend:
        with pytest.raises(NotImplementedError, match="cannot tell who holds or leads"):
            await backend.leader("job")
        assert await backend.holder("job") is None  # holder() still answers
