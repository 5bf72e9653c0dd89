"""Counting semaphores in ZooKeeper (``backend.semaphore(name, limit)``; the rules are
:mod:`asynclock._core.permit_store`'s). A semaphore ``name`` is, under
``<prefix>/%00asynclock.sem/<name>`` (asynclock's reserved area, where no lock's node
can be: :func:`._paths.reserved_path`):

* ``p/<slot>`` — one EPHEMERAL node per live permit (slot 0 .. limit-1, in decimal; data:
  the owner and ttl, as a lock node's), on the driver's one session (:mod:`._held`: a
  lost session loses every permit, a permit the core stops renewing is deleted locally);
* ``limit`` — a persistent node whose data is the limit of the live permits (kept).

* **Grant**: one ``multi``: ``check(limit, version)`` (the limit node still holds our
  limit, at the data version last read) + ``create(p/<slot>)`` + ``set(p/<slot>)`` (whose
  stat gives the new node's czxid in the same answer). ``create`` fails with NodeExists
  when the slot is taken: then one listing of ``p`` and the grant tries a free slot at once.
* **Limit**: the first grant, or one that finds no live permit, sets the limit in the same
  ``multi`` as its permit: ``set(limit, version)`` + ``delete(p)`` + ``create(p)`` (the
  delete fails with NotEmpty while any permit lives) + the permit; while permits of
  another limit live, a grant answers ``OtherLimit`` and never creates a node.
* **Guard**: ``g/<slot>``, a persistent node the grant's ``multi`` also writes, so a
  release deletes only the node it read (:mod:`._held`); made by a slot's first grant.
* **Token**: from the permit node's czxid, the ensemble's transaction id of its creation
  (on the wipe marker's base, :mod:`._era`): strictly above every token granted before,
  for this slot and every other (G2). No grant in the restart grace (``Full``).
* **Queue** (first come, first served): ``q/<owner>-<sequence>``, one EPHEMERAL_SEQUENTIAL
  node per queued waiter, kept by each ask's ``set`` and lapsing by the leader's clock
  (:mod:`._places`). The grant's ``multi`` also checks ``q``'s data version (an asker
  without a place) or deletes the lapsed places ahead at the versions read, and deletes
  the asker's own place.
* **Holders**: the limit node and the listing of ``p`` in one round trip, then every
  permit node in one more; no permit has an expiry at the server (``remaining`` None): its
  node lives as long as its holder's session, and its ttl is the holder's local deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from ..._core.driver import SENT_AT, ExtendResult, LeaseRef
from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from ..._core.permit_store import (
    Answer,
    Full,
    Granted,
    OtherLimit,
    PermitStore,
    permit_holder,
)
from ..._core.semaphore import LEASE_PREFIX
from ._held import HeldNode
from ._kazoo import NodeExistsError, NoNodeError, Op, Stat
from ._nodes import decode_data, encode_data
from ._paths import reserved_path
from ._places import Places, Verdict

if TYPE_CHECKING:
    from .driver import ZooKeeperDriver

#: A grant's attempts in one call before it answers Full (the core backs off and retries).
ATTEMPTS = 4


class ZkPermits(PermitStore):
    """A semaphore's permits in a ZooKeeper ensemble (see the module)."""

    renew_chunk = None  # one sync renews them all, whatever the count
    queues_locally = True  # behind the driver's IN_FLIGHT requests; the grant sets SENT_AT

    def __init__(self, driver: ZooKeeperDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.driver = driver
        self.nodes = driver.nodes
        self.display = driver.display
        self.base = reserved_path(driver.prefix, "sem", name)
        self.limit_path, self.permits = self.base + "/limit", self.base + "/p"
        self._lease_name = LEASE_PREFIX + name
        #: owner -> the slot of its grant under way (an interrupted grant's release).
        self._tried: dict[str, int] = {}
        self.places = Places(self)

    def path(self, slot: int) -> str:
        return f"{self.permits}/{slot}"

    def guard(self, slot: int) -> str:
        """The slot's guard: a persistent node every grant of the slot writes (kept)."""
        return f"{self.base}/g/{slot}"

    async def withdraw(self, owner: str) -> None:
        await self.places.withdraw(owner)

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        trying: list[int] = []
        try:
            answer = await self._grant(owner, ttl, queue, trying)
            if queue and isinstance(answer, Full) and owner not in self.places.mine:
                await self.places.judge(owner, ttl, queue, fast=False)  # takes its place
        finally:
            self.trying.difference_update(trying)
        self._tried.pop(owner, None)  # kept if interrupted: release_permit looks there
        return answer

    async def _look(self) -> tuple[int | None, int | None, set[int] | None]:
        """(the limit held, its node's data version, the live slots): None if absent."""
        got, listed = await self.driver._call(
            f"semaphore {self.name!r}",
            partial(self.driver.zk.get_and_children, self.limit_path, self.permits),
        )
        held = version = None
        if not isinstance(got, NoNodeError):
            if isinstance(got, BaseException):
                raise got
            data, stat = got
            version = stat.version
            held = int(data) if data.isdigit() else None
        if isinstance(listed, NoNodeError):
            return held, version, None
        if isinstance(listed, BaseException):
            raise listed
        return held, version, {int(c) for c in listed if c.isdigit()}

    async def _grant(self, owner: str, ttl: float, queue: bool, trying: list[int]) -> Answer:
        data, ours = encode_data(owner, ttl), b"%d" % self.limit
        call, zk = self.driver._call, self.driver.zk
        era = await self.driver.eras.current()
        grace = self.driver.eras.busy(era, ttl)
        if grace is not None:
            return Full(grace.retry_after)
        slot = self.guess_slot((), trying)
        verdict: Verdict | None = None
        for _ in range(ATTEMPTS):
            if slot is None:
                return Full()
            known = self.nodes.limits.get(self.name)
            setting: list[Op] = []
            if known is None or known[0] != self.limit:
                held, version, live = await self._look()
                if held == self.limit and version is not None and live is not None:
                    self.nodes.limits[self.name] = known = (self.limit, version)
                elif live and held is not None:
                    return OtherLimit(held)  # permits of another limit live: no node made
                else:  # none live: set the limit with this permit, if none comes first
                    setting = [
                        Op("create", self.limit_path, ours)
                        if version is None
                        else Op("set", self.limit_path, ours, version),
                        *([] if live is None else [Op("delete", self.permits)]),
                        Op("create", self.permits),
                    ]
                if live and slot in live:
                    slot = self.guess_slot(live, trying)
                    if slot is None:
                        return Full()
            if verdict is None:  # first come, first served: the queue (see _places)
                verdict = await self.places.judge(owner, ttl, queue, fast=True)
            if not verdict.go:
                seen = self.places.limit_version
                if known is not None and seen is not None and seen != known[1]:
                    self.nodes.limits.pop(self.name, None)  # the limit changed: look again
                    verdict = None
                    continue
                return Full(ahead=verdict.ahead)
            queued = verdict.ops
            path = self.path(slot)
            self.nodes.guards[path] = self.guard(slot)  # what its deletes check (see _held)
            self._tried[owner] = slot
            take = [
                Op("create", path, data, ephemeral=True),
                Op("set", path, data, 0),
                Op("set", self.guard(slot)),  # moves the slot's guard (see _held)
            ]
            check = (
                [] if setting or known is None else [Op("check", self.limit_path, version=known[1])]
            )
            ops = [*setting, *check, *queued, *take]
            session = zk.session_id  # the node lives as long as this session
            done = await call(f"acquire of semaphore {self.name!r}", partial(zk.multi, ops))
            if done.failed_at is None:
                stat = done.results[-2]
                assert isinstance(stat, Stat)
                self.places.granted(owner)  # its place went in the same multi
                if not self.driver.eras.holds(era, session):  # a new session: its era first
                    self.nodes.orphans[path] = (stat.czxid, owner)
                    return Full(0.0)
                if setting:
                    first = done.results[0]
                    version = first.version if isinstance(first, Stat) else 0
                    self.nodes.limits[self.name] = (self.limit, version)
                t_send = SENT_AT.get()
                token = era.token(stat.czxid)
                self.nodes.add(
                    HeldNode(
                        path,
                        owner,
                        stat.czxid,
                        token,
                        session,
                        ttl,
                        t_send + ttl,
                        self._lease_name,
                    )
                )
                return Granted(slot, token)
            at = done.failed_at - len(setting) - len(check)
            if 0 <= at < len(queued):  # the queue changed since the look: look again
                self.places.forget()
                verdict = None
                continue
            unguarded = done.failed_at == len(ops) - 1 and isinstance(done.error, NoNodeError)
            if unguarded:  # the slot's first grant: make its guard
                await call("semaphore setup", partial(zk.ensure_path, self.guard(slot)))
                continue
            if done.failed_at == len(ops) - 3 and isinstance(done.error, NodeExistsError):
                live = {int(c) for c in await self._children() if c.isdigit()}
                slot = self.guess_slot(live, trying)  # the slot is taken: a free one, at once
                continue
            self.nodes.limits.pop(self.name, None)  # the limit or the layout changed: look
            if isinstance(done.error, NoNodeError):
                await call("semaphore setup", partial(zk.ensure_path, self.base))
        return Full()

    async def _children(self) -> list[str]:
        try:
            return await self.driver._call(
                f"semaphore {self.name!r}", partial(self.driver.zk.children, self.permits)
            )
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, NoNodeError):
                return []
            raise

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        refs = []
        for ref in leases:
            slot = self.slots.get(ref.owner)
            refs.append(("" if slot is None else self.path(slot), ref))
        return await self.nodes.renew(refs)

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        if slot is not None:
            czxid = None if token is None else self.driver.eras.zxid(token)
            return await self.nodes.delete(self.path(slot), czxid, owner)
        # An interrupted grant (its answer may be lost): the slot it tried, if ours.
        tried = self._tried.pop(owner, None)
        if tried is None:
            return False
        return await self.nodes.delete(self.path(tried), None, owner)

    async def holders(self) -> list[Holder]:
        zk = self.driver.zk

        async def read() -> list[Holder]:
            era = await self.driver.eras.current()
            got, listed = await zk.get_and_children(self.limit_path, self.permits)
            if isinstance(listed, NoNodeError):
                return []
            if isinstance(listed, BaseException):
                raise listed
            limit = None
            if not isinstance(got, BaseException) and got[0].isdigit():
                limit = int(got[0])
            slots = sorted(int(c) for c in listed if c.isdigit())
            nodes, _ = await zk.read_many([self.path(slot) for slot in slots])
            found: list[Holder] = []
            for slot, node in zip(slots, nodes, strict=True):
                if isinstance(node, NoNodeError):
                    continue  # released since the listing
                if isinstance(node, BaseException):
                    raise node
                data, stat = node
                if stat.ephemeral:  # (a permit's node always is)
                    owner = decode_data(data)[0]
                    token = era.token(stat.czxid)
                    found.append(permit_holder(self.name, slot, owner, token, None, limit))
            return found

        return await self.driver._call(f"listing semaphore {self.name!r}", read)
