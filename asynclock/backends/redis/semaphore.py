"""Semaphores on one Redis server: the scripts of :mod:`.sem_scripts`, one round trip each
(a grant, which also keeps a blocking waiter's place in the wait queue; a renewal of every
permit of the semaphore held here; a release; a waiter's withdrawal from the queue).

The calls are written once, against a node and its epoch key (:class:`SemCalls`): the
one-server store (:class:`RedisPermits`) makes them on its server, the store of
``redis+sentinel://`` and ``redis+cluster://`` (:mod:`.routed_holds`) on the primary that
serves the name.

A release that frees a permit, and a withdrawal that removes a place, PUBLISH on the lock
channel of the semaphore's reserved wake name (``_core/wakes.py``), which its waiters in
every process watch with the driver's lock watch: they try again at once instead of at
their next poll."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.permit_store import (
    LEASE_PREFIX,
    Answer,
    Full,
    Granted,
    OtherLimit,
    PermitStore,
    permit_holder,
    place_ttl,
)
from ..._core.wakes import wake_name
from .keys import hash_tag, keys_for
from .replies import grace_ms
from .wire import Node, ms

if TYPE_CHECKING:
    from .single import RedisDriver


def semaphore_keys(name: str, prefix: str) -> tuple[bytes, bytes]:
    """The sorted set of live permits and the hash of slots (see :mod:`.sem_scripts`).
    Both carry the name's hash tag, as its lock key does: one Redis Cluster slot, the
    slot whose epoch key the grant takes."""
    base = f"{prefix}sem:{{{hash_tag(name)}}}"
    return base.encode(), (base + ":h").encode()


def place_keys(name: str, prefix: str) -> tuple[bytes, bytes]:
    """The wait queue's two sorted sets, of places by arrival and by when they lapse (see
    :mod:`.sem_scripts`): under the same hash tag as :func:`semaphore_keys`."""
    base = f"{prefix}sem:{{{hash_tag(name)}}}"
    return (base + ":q").encode(), (base + ":qx").encode()


class SemCalls:
    """The scripts of one semaphore (its keys and limit), on any node."""

    def __init__(self, name: str, limit: int, prefix: str) -> None:
        self.keys = semaphore_keys(name, prefix)
        self.places = place_keys(name, prefix)
        self.limit = limit
        #: Where a release publishes (see the module).
        self.channel = keys_for(wake_name(LEASE_PREFIX + name), prefix).channel.encode()

    async def grant(
        self,
        node: Node,
        epoch: bytes,
        grace: float | None,
        owner: str,
        ttl: float,
        queue: bool,
    ) -> Answer:
        """SEM_GRANT on ``node``, whose epoch key for the name is ``epoch``; ``grace``: its
        driver's ``restart_grace``; ``queue``: keep ``owner``'s place when not granted."""
        ttl_ms = ms(ttl)
        args = (
            owner.encode(),
            b"%d" % ttl_ms,
            b"%d" % self.limit,
            grace_ms(grace, ttl_ms),
            b"1" if queue else b"0",
            b"%d" % ms(place_ttl(ttl)),
        )
        keys = (*self.keys, epoch, *self.places)
        first, second = (int(x) for x in await node.run("sem_grant", keys, args))
        if first == -2:
            return OtherLimit(second)
        if first == -1:
            return Full(None if second < 0 else second / 1000)
        return Granted(first, second)

    async def withdraw(self, node: Node, owner: str) -> None:
        """SEM_WITHDRAW on ``node``: ``owner``'s place leaves the queue (waiters behind it
        are woken)."""
        await node.run("sem_withdraw", self.places, (owner.encode(), self.channel))

    async def extend(
        self, node: Node, slots: dict[str, int], leases: Sequence[LeaseRef]
    ) -> list[ExtendResult]:
        args: list[bytes] = []
        known: list[bool] = []
        for ref in leases:
            slot = slots.get(ref.owner)
            known.append(slot is not None)
            if slot is not None:
                args += [b"%d" % slot, ref.owner.encode(), b"%d" % ref.token, b"%d" % ms(ref.ttl)]
        reply = await node.run("sem_extend", self.keys, args) if args else []
        codes = iter(reply)
        gone = Refused("the permit expired or was taken over")
        return [True if ok and int(next(codes)) == 1 else gone for ok in known]

    async def release(self, node: Node, owner: str, slot: int | None, token: int | None) -> bool:
        args = (
            b"" if slot is None else b"%d" % slot,
            owner.encode(),
            b"" if token is None else b"%d" % token,
            self.channel,
        )
        return bool(await node.run("sem_release", self.keys, args))

    async def holders(self, node: Node, name: str) -> list[Holder]:
        """SEM_HOLDERS on ``node``: the live permits of ``name``, by slot."""
        reply = await node.run("sem_holders", self.keys, ())
        limit = int(reply[0]) if reply[0] else None
        rows = [reply[k : k + 4] for k in range(1, len(reply), 4)]
        found = [
            permit_holder(name, int(s), o.decode(errors="replace"), int(t), int(x) / 1000, limit)
            for s, o, t, x in rows
        ]
        return sorted(found, key=lambda h: h.slot or 0)


class RedisPermits(PermitStore):
    """A semaphore's permits on one Redis server."""

    def __init__(self, driver: RedisDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.node = driver.node
        self.display = driver.display
        self.calls = SemCalls(name, limit, driver.prefix)
        self.keys = self.calls.keys
        self._epoch = driver.keys.epoch
        self._grace = driver.restart_grace
        self.waker = driver

    async def withdraw(self, owner: str) -> None:
        await self.calls.withdraw(self.node, owner)

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        return await self.calls.grant(self.node, self._epoch, self._grace, owner, ttl, queue)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        return await self.calls.extend(self.node, self.slots, leases)

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        return await self.calls.release(self.node, owner, slot, token)

    async def holders(self) -> list[Holder]:
        return await self.calls.holders(self.node, self.name)
