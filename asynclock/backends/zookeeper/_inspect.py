"""The ZooKeeper driver's answers about a lock's holder: who holds it, is a token
current, and breaking it (an operator's delete of the holder's node)."""

from __future__ import annotations

from functools import partial
from urllib.parse import unquote

from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from . import _paths
from ._era import Eras
from ._kazoo import NoNodeError
from ._nodes import decode_data
from ._watches import Watches


class Inspect(Watches):
    """The holder half of :class:`~asynclock.backends.zookeeper.driver.ZooKeeperDriver`
    (its watches and deletes are :class:`~._watches.Watches`')."""

    display: str
    prefix: str
    eras: Eras

    def lock_path(self, name: str) -> str:
        raise NotImplementedError  # pragma: no cover - the driver's

    async def _first(self, name: str) -> str | None:
        """The path of the holder's node of ``name`` (the lowest contender), or None."""
        lock = self.lock_path(name)
        try:
            children = await self._call("listing", partial(self.zk.children, lock))
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, NoNodeError):
                return None
            raise
        order = _paths.contenders(children)
        return f"{lock}/{order[0]}" if order else None

    async def validate(self, name: str, token: int) -> bool:
        era = await self.eras.current()
        for _ in range(3):
            first = await self._first(name)
            if first is None:
                return False
            stat = await self._call("validate", partial(self.zk.exists, first))
            if stat is not None:
                return stat.ephemeral and era.token(stat.czxid) == token
        return False

    async def holder(self, name: str) -> Holder | None:
        era = await self.eras.current()
        for _ in range(3):
            first = await self._first(name)
            if first is None:
                return None
            try:
                data, stat = await self._call("holder", partial(self.zk.get, first))
            except BackendUnavailable as exc:
                if isinstance(exc.__cause__, NoNodeError):
                    continue  # released just now: look again
                raise
            if not stat.ephemeral:  # another application's node (not a lock): not held
                return None
            owner, _ = decode_data(data)
            # No expiry at the server: a node lasts as long as its holder's session, and
            # the holder's ttl is its own local deadline (renewed without a write).
            return Holder(name, owner, era.token(stat.czxid), None)
        return None

    async def break_lock(self, name: str) -> bool:
        first = await self._first(name)
        if first is None:
            return False
        stat = await self._call("break", partial(self.zk.exists, first))
        if stat is not None and not stat.ephemeral:
            raise BackendUnavailable(
                f"{self.display}: {first} is a persistent node, not a lock's: every lock "
                "protocol's contender is an ephemeral sequential node, so this one belongs "
                "to another application (its data, not a holder); not deleted"
            )
        # G2: whoever comes next creates a node with a larger czxid; the broken holder's
        # next renewal finds its node gone (refused).
        broken = await self._delete(first)
        for owner, node in list(self.held.items()):
            if node.path == first:
                del self.held[owner]
        self._wake_behind(first)
        return broken

    async def hold_names(self) -> tuple[list[str], list[str]]:
        # The children of the reserved area's semaphore and read-write lock nodes, each
        # a whole name quoted as one segment (see _paths.reserved_path): every name ever
        # used (its base node is kept); the core asks each one's holders.
        found: list[list[str]] = []
        for kind in ("sem", "rw"):
            area = f"{self.prefix}/{_paths.RESERVED}{kind}"
            try:
                children = await self._call("listing", partial(self.zk.children, area))
            except BackendUnavailable as exc:
                if not isinstance(exc.__cause__, NoNodeError):
                    raise
                children = []
            found.append([unquote(c, errors="surrogatepass") for c in children])
        return found[0], found[1]


__all__ = ("Inspect",)
