"""Read-write locks in ZooKeeper (``backend.rwlock(name)``; the rules are
:mod:`asynclock._core.rw_store`'s). A read-write lock ``name`` is, under
``<prefix>/%00asynclock.rw/<name>`` (asynclock's reserved area: apart from every lock's
nodes, see :func:`._paths.reserved_path`):

* ``w`` — the writer: an EPHEMERAL node (data: its owner and ttl); its czxid gives the
  writer epoch, the ensemble's transaction id, so it only rises (G2);
* ``e`` — the epoch: a persistent node written in the same ``multi`` as ``w`` (one
  transaction, one zxid), so its mzxid is the last writer's, whose token every reader
  gets (the wipe marker's base before the first write: ``e`` not written yet; tokens
  are on that base, :mod:`._era`);
* ``r/<owner>`` — one ephemeral node per reader; ``i/<owner>`` — one per waiting
  writer's intent; all on the driver's one session (:mod:`._held` deletes locally what the
  core stops renewing, or an intent its writer stopped refreshing).

Each grant is one ``multi``. "No node" is asserted with ZooKeeper's own errors: a read
``create(w)`` + ``delete(w)`` (NodeExists while a writer holds) and ``delete(i)`` +
``create(i)`` (NotEmpty while a writer waits), then creates ``r/<owner>``; a write
``create(w)`` and ``delete(r)`` + ``create(r)`` (NotEmpty while a reader holds), writes
``e``, and deletes its own intent. A refused writer that waits then records its intent
(readers that came in between are only a delay: from then on no new reader is granted).

Holders: ``w``, ``e`` and the listings of ``r`` and ``i`` in one round trip, then every
reader's and intent's node in one more. No hold has an expiry at the server
(``remaining`` None): its node lives as long as its holder's session.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from ..._core.driver import SENT_AT, ExtendResult, LeaseRef
from ..._core.holder import Holder
from ..._core.rw_store import (
    READ,
    READERS_HOLD,
    WRITER_HOLDS,
    WRITER_WAITS,
    Held,
    RWAnswer,
    RWStore,
    rw_holders,
)
from ..._core.rwlock import LEASE_PREFIX
from ._held import HeldNode
from ._kazoo import NoNodeError, Op, Stat
from ._nodes import decode_data, encode_data
from ._paths import node_name, reserved_path

if TYPE_CHECKING:
    from .driver import ZooKeeperDriver


class ZkRW(RWStore):
    """A read-write lock in a ZooKeeper ensemble (see the module)."""

    renew_chunk = None  # one sync renews them all, whatever the count
    queues_locally = True  # behind the driver's IN_FLIGHT requests; the grant sets SENT_AT

    def __init__(self, driver: ZooKeeperDriver, name: str) -> None:
        super().__init__(name)
        self.driver = driver
        self.nodes = driver.nodes
        self.display = driver.display
        base = reserved_path(driver.prefix, "rw", name)
        self.writer, self.epoch = base + "/w", base + "/e"
        self.readers, self.intents = base + "/r", base + "/i"
        # Every writer's grant writes the epoch in its multi: the writer node's guard.
        self.nodes.guards[self.writer] = self.epoch
        self._lease_name = LEASE_PREFIX + name
        #: Owners whose intent may be at the server (withdraw looks only for those).
        self._intending: set[str] = set()

    def _path(self, mode: str, owner: str) -> str:
        return f"{self.readers}/{node_name(owner)}" if mode == READ else self.writer

    def _intent(self, owner: str) -> str:
        return f"{self.intents}/{node_name(owner)}"

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        data = encode_data(owner, ttl)
        path, intent = self._path(mode, owner), self._intent(owner)
        call, zk = self.driver._call, self.driver.zk
        what = f"acquire of rwlock {self.name!r}"
        era = await self.driver.eras.current()
        grace = self.driver.eras.busy(era, ttl)
        if grace is not None:
            return Held("the ZooKeeper data is new: restart grace", grace.retry_after)
        for _ in range(3):
            take = Op("create", path, data, ephemeral=True)
            read = None
            if mode == READ:
                ops = [
                    Op("create", self.writer),  # no writer
                    Op("delete", self.writer),
                    Op("delete", self.intents),  # no waiting writer
                    Op("create", self.intents),
                    take,
                    Op("set", path, data, 0),  # its stat: our node's czxid
                ]
                read = self.epoch
            else:
                ops = [
                    take,  # no writer
                    Op("delete", self.readers),  # no reader
                    Op("create", self.readers),
                    Op("set", self.epoch),  # its stat: the new epoch (the writer's czxid)
                ]
                mine = self.nodes.entries.get(intent)
                if mine is not None and mine.owner == owner:
                    ops.append(Op("delete", intent))
            session = zk.session_id  # the node lives as long as this session
            done = await call(what, partial(zk.multi, ops, read))
            if done.failed_at is None:
                stat = done.results[-1] if mode == READ else done.results[3]
                assert isinstance(stat, Stat)
                if not self.driver.eras.holds(era, session):  # a new session: its era first
                    self.nodes.orphans[path] = (stat.czxid if mode == READ else stat.mzxid, owner)
                    return Held("the ZooKeeper session changed", 0.0)
                if mode == READ:
                    epoch = done.read
                    czxid = stat.czxid
                    written = epoch is not None and epoch.version > 0
                    token = era.token(epoch.mzxid) if written and epoch else era.base
                else:
                    czxid = stat.mzxid
                    token = era.token(czxid)
                    if len(ops) == 5:
                        self.nodes.drop(intent)
                    self._intending.discard(owner)
                self.nodes.add(
                    HeldNode(
                        path,
                        owner,
                        czxid,
                        token,
                        session,
                        ttl,
                        SENT_AT.get() + ttl,
                        self._lease_name,
                    )
                )
                return token
            if isinstance(done.error, NoNodeError):
                if done.failed_at == 4 and mode != READ:  # our intent vanished
                    self.nodes.drop(intent)
                else:
                    await self._setup()
                continue
            if mode == READ:
                return Held(WRITER_HOLDS if done.failed_at == 0 else WRITER_WAITS)
            if intend:
                await self._intend(owner, intent, data, ttl)
            return Held(WRITER_HOLDS if done.failed_at == 0 else READERS_HOLD)
        return Held("the read-write lock's nodes keep vanishing")

    async def _setup(self) -> None:
        for path in (self.readers, self.intents, self.epoch):
            await self.driver._call("rwlock setup", partial(self.driver.zk.ensure_path, path))

    async def _intend(self, owner: str, intent: str, data: bytes, ttl: float) -> None:
        """Record (or keep) a waiting writer's intent for ``ttl`` more seconds."""
        now = self.driver.clock.now()
        mine = self.nodes.entries.get(intent)
        if mine is not None and mine.owner == owner:
            self.nodes.expires(mine, now + ttl)
            return
        zk = self.driver.zk
        self._intending.add(owner)
        for _ in range(2):
            session = zk.session_id
            create = [Op("create", intent, data, ephemeral=True)]
            done = await self.driver._call("writer intent", partial(zk.multi, create))
            if isinstance(done.error, NoNodeError):
                await self._setup()
                continue
            # Created, or there already (its path is this owner's alone): ours.
            self.nodes.add(HeldNode(intent, owner, None, 0, session, ttl, now + ttl, None))
            return

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        return await self.nodes.renew([(self._path(mode, r.owner), r) for r in leases])

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        path = self._path(mode, owner)
        entry = self.nodes.entries.get(path)
        if entry is not None and entry.owner == owner:
            if token is not None and token != entry.token:
                return False
            return await self.nodes.delete(path, entry.czxid, owner)
        if token is not None and mode != READ:  # the writer's czxid
            return await self.nodes.delete(path, self.driver.eras.zxid(token), owner)
        # A reader's node is its owner's alone: guarded by the owner in its data.
        return await self.nodes.delete(path, None, owner)

    async def withdraw(self, owner: str) -> None:
        if owner in self._intending:
            self._intending.discard(owner)
            await self.nodes.delete(self._intent(owner), None, owner)

    async def holders(self) -> list[Holder]:
        zk = self.driver.zk

        def owners(nodes: list[tuple[bytes, Stat] | BaseException]) -> list[tuple[str, None]]:
            found: list[tuple[str, None]] = []
            for node in nodes:
                if isinstance(node, NoNodeError):
                    continue  # released since the listing
                if isinstance(node, BaseException):
                    raise node
                if node[1].ephemeral:
                    found.append((decode_data(node[0])[0] or "?", None))
            return found

        async def read() -> list[Holder]:
            era = await self.driver.eras.current()
            parents = [self.readers, self.intents]
            (w, e), listed = await zk.read_many([self.writer, self.epoch], parents)
            paths: list[list[str]] = []
            for parent, children in zip(parents, listed, strict=True):
                if isinstance(children, BaseException) and not isinstance(children, NoNodeError):
                    raise children
                kids = [] if isinstance(children, BaseException) else sorted(children)
                paths.append([f"{parent}/{c}" for c in kids])
            nodes, _ = await zk.read_many([*paths[0], *paths[1]])
            if isinstance(e, BaseException) and not isinstance(e, NoNodeError):
                raise e
            # The epoch node's last write is the last writer's grant (0 before any).
            epoch = 0 if isinstance(e, BaseException) or e[1].version == 0 else e[1].mzxid
            writer = owners([w])
            return rw_holders(
                self.name,
                era.token(epoch) if epoch else era.base,
                writer[0] if writer else None,
                owners(nodes[: len(paths[0])]),
                owners(nodes[len(paths[0]) :]),
            )

        return await self.driver._call(f"listing rwlock {self.name!r}", read)


__all__ = ("ZkRW",)
