"""Read-write locks on one Redis server: the three scripts of :mod:`.rw_scripts`, one
round trip each (a grant, a renewal of every hold of one mode held here, a release).

As for semaphores, the calls are written once against a node and its epoch key
(:class:`RWCalls`), for the one-server store (:class:`RedisRW`) and the routed one
(:mod:`.routed_holds`). A release (or an intent withdrawn) PUBLISHes on the lock channel
of the read-write lock's reserved wake name, as a semaphore's release does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.holder import Holder
from ..._core.rw_store import (
    LEASE_PREFIX,
    READERS_HOLD,
    WRITER_HOLDS,
    WRITER_WAITS,
    Held,
    Live,
    RWAnswer,
    RWStore,
    rw_holders,
)
from ..._core.wakes import wake_name
from .keys import hash_tag, keys_for
from .replies import grace_ms
from .wire import Node, ms

if TYPE_CHECKING:
    from .single import RedisDriver

_WHY = {
    1: WRITER_HOLDS,
    2: READERS_HOLD,
    3: WRITER_WAITS,
    4: "the Redis server lost its data and is in its restart grace",
}


def rwlock_keys(name: str, prefix: str) -> tuple[bytes, bytes, bytes]:
    """The hash, the readers' and the intents' sorted sets (see :mod:`.rw_scripts`), all
    under the name's hash tag (one Redis Cluster slot, with that slot's epoch key)."""
    base = f"{prefix}rw:{{{hash_tag(name)}}}"
    return base.encode(), (base + ":r").encode(), (base + ":i").encode()


class RWCalls:
    """The scripts of one read-write lock (its keys), on any node."""

    def __init__(self, name: str, prefix: str) -> None:
        self.keys = rwlock_keys(name, prefix)
        #: Where a release publishes (see the module).
        self.channel = keys_for(wake_name(LEASE_PREFIX + name), prefix).channel.encode()

    async def grant(
        self,
        node: Node,
        epoch: bytes,
        grace: float | None,
        mode: str,
        owner: str,
        ttl: float,
        *,
        intend: bool,
    ) -> RWAnswer:
        """RW_GRANT on ``node``, whose epoch key for the name is ``epoch``; ``grace``: its
        driver's ``restart_grace``."""
        ttl_ms = ms(ttl)
        intent = b"1" if intend else b"0"
        args = (mode.encode(), owner.encode(), b"%d" % ttl_ms, intent, grace_ms(grace, ttl_ms))
        reply = [int(x) for x in await node.run("rw_grant", (*self.keys, epoch), args)]
        if reply[0] == 1:
            return reply[1]
        return Held(_WHY[reply[1]], None if reply[2] < 0 else reply[2] / 1000)

    async def extend(self, node: Node, mode: str, leases: Sequence[LeaseRef]) -> list[ExtendResult]:
        args: list[bytes] = [mode.encode()]
        for ref in leases:
            args += [ref.owner.encode(), b"%d" % ref.token, b"%d" % ms(ref.ttl)]
        reply = await node.run("rw_extend", self.keys, args)
        gone = Refused("the hold expired or was freed")
        return [True if int(code) == 1 else gone for code in reply]

    async def release(self, node: Node, mode: str, owner: str, token: int | None) -> bool:
        token_arg = b"" if token is None else b"%d" % token
        args = (mode.encode(), owner.encode(), token_arg, self.channel)
        return bool(await node.run("rw_release", self.keys, args))

    async def holders(self, node: Node, name: str) -> list[Holder]:
        """RW_HOLDERS on ``node``: the live writer, readers and intents of ``name``."""
        epoch, writer, readers, intents = await node.run("rw_holders", self.keys, ())

        def pairs(flat: list[bytes]) -> list[Live]:
            return [
                (flat[k].decode(errors="replace"), int(flat[k + 1]) / 1000)
                for k in range(0, len(flat), 2)
            ]

        w = pairs(writer)
        return rw_holders(name, int(epoch), w[0] if w else None, pairs(readers), pairs(intents))


class RedisRW(RWStore):
    """A read-write lock on one Redis server."""

    def __init__(self, driver: RedisDriver, name: str) -> None:
        super().__init__(name)
        self.node = driver.node
        self.display = driver.display
        self.calls = RWCalls(name, driver.prefix)
        self.keys = self.calls.keys
        self._epoch = driver.keys.epoch
        self._grace = driver.restart_grace
        self.waker = driver

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        calls = self.calls
        return await calls.grant(
            self.node, self._epoch, self._grace, mode, owner, ttl, intend=intend
        )

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        return await self.calls.extend(self.node, mode, leases)

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        return await self.calls.release(self.node, mode, owner, token)

    async def withdraw(self, owner: str) -> None:
        await self.calls.release(self.node, "i", owner, None)

    async def holders(self) -> list[Holder]:
        return await self.calls.holders(self.node, self.name)
