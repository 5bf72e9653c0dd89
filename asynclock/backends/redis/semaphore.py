"""Semaphores on one Redis server: the three scripts of :mod:`.sem_scripts`, one round
trip each (a grant, a renewal of every permit of the semaphore held here, a release)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.permit_store import Answer, Full, Granted, OtherLimit, PermitStore
from .keys import hash_tag
from .replies import grace_ms
from .wire import ms

if TYPE_CHECKING:
    from .single import RedisDriver


def semaphore_keys(name: str, prefix: str) -> tuple[bytes, bytes]:
    """The sorted set of live permits and the hash of slots (see :mod:`.sem_scripts`)."""
    base = f"{prefix}sem:{{{hash_tag(name)}}}"
    return base.encode(), (base + ":h").encode()


class RedisPermits(PermitStore):
    """A semaphore's permits on one Redis server."""

    def __init__(self, driver: RedisDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.node = driver.node
        self.display = driver.display
        self.keys = semaphore_keys(name, driver.prefix)
        self._epoch = driver.keys.epoch
        self._grace = driver.restart_grace

    async def grant(self, owner: str, ttl: float) -> Answer:
        ttl_ms = ms(ttl)
        args = (owner.encode(), b"%d" % ttl_ms, b"%d" % self.limit, grace_ms(self._grace, ttl_ms))
        keys = (*self.keys, self._epoch)
        first, second = (int(x) for x in await self.node.run("sem_grant", keys, args))
        if first == -2:
            return OtherLimit(second)
        if first == -1:
            return Full(second / 1000)
        return Granted(first, second)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        args: list[bytes] = []
        known: list[bool] = []
        for ref in leases:
            slot = self.slots.get(ref.owner)
            known.append(slot is not None)
            if slot is not None:
                args += [b"%d" % slot, ref.owner.encode(), b"%d" % ref.token, b"%d" % ms(ref.ttl)]
        reply = await self.node.run("sem_extend", self.keys, args) if args else []
        codes = iter(reply)
        gone = Refused("the permit expired or was taken over")
        return [True if ok and int(next(codes)) == 1 else gone for ok in known]

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        args = (
            b"" if slot is None else b"%d" % slot,
            owner.encode(),
            b"" if token is None else b"%d" % token,
        )
        return bool(await self.node.run("sem_release", self.keys, args))
