"""Nodes of semaphore permits, read-write holds and writers' intents on the ZooKeeper
driver's one session.

Each is an ephemeral node of the session (its locks' session), so a lost session loses
them all, and a crashed process's go when the server expires its session. While the
process lives the session lives on for its other users, so this registry expires locally
what the core stops renewing (a lease lost here, an intent of a writer that stopped
waiting): its node is deleted once its ttl has passed since the last confirmed renewal,
as the driver does for its locks.

Renewal writes nothing: one ``sync`` round trip per call proves the session alive and
delivers first every watch event of a write committed before it; each held node is
watched, so one deleted behind our back (an operator) is refused at that renewal.
Deletes are guarded: a node is deleted only if its ``czxid`` is the one we created (or,
when that is not known, its data names our owner), so a late release never deletes
another holder's node of the same path. The read and the delete are two steps, and a
``multi``'s ``check`` compares a data version only (a re-created node has the same one),
so a path that other holders are granted (a permit's slot, the writer's node) has a
**guard**: a persistent node that every grant of the path writes in its ``multi``. The
delete is ``multi(check(guard, version read), delete(node, version read))``, the guard
read just before the node: no grant of the path came in between, so the node deleted is
the one read (an operator's manual delete plus a new grant in that window used to lose
the new holder its node). A reader's and an intent's path is its owner's alone: no guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from ..._core.driver import ExtendResult, LeaseRef, Refused
from ..._core.exceptions import BackendUnavailable
from ._kazoo import BadVersionError, NoNodeError, Op, Stat
from ._nodes import decode_data

if TYPE_CHECKING:
    from .driver import ZooKeeperDriver


@dataclass(eq=False, slots=True)
class HeldNode:
    """One node of ours: a permit, a read or write hold, or a writer's intent."""

    path: str
    owner: str
    #: The node's czxid (None: not known; its data names the owner).
    czxid: int | None
    #: What the core holds as the lease's token (a permit's or a writer's: the czxid; a
    #: reader's: the epoch it was granted with).
    token: int
    session: int | None
    ttl: float
    expires_at: float
    #: The core's lease name, to tell a loss out of band (None: an intent, no lease).
    lease_name: str | None
    gone: bool = False  # its watch saw it deleted: the next renewal is refused


class HeldNodes:
    """The driver's registry of permit, hold and intent nodes (see the module)."""

    def __init__(self, driver: ZooKeeperDriver) -> None:
        self.driver = driver
        self.entries: dict[str, HeldNode] = {}
        #: path -> (czxid or None, owner) of nodes of ours still to delete.
        self.orphans: dict[str, tuple[int | None, str]] = {}
        #: path -> its guard (see the module), for the paths that have one.
        self.guards: dict[str, str] = {}
        #: The limit and its node's data version of each semaphore name, as last read.
        self.limits: dict[str, tuple[int, int]] = {}
        #: Each semaphore name's queue as last listed: q's data version and its places'
        #: names in queue order (see :mod:`._places`).
        self.queues: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._unwatched: list[HeldNode] = []
        #: No entry expires before this (see ``ZooKeeperDriver._held_due``): an entry's
        #: expiry only moves later unless :meth:`expires` is told.
        self._due = math.inf

    def add(self, entry: HeldNode) -> None:
        self.entries[entry.path] = entry
        self._due = min(self._due, entry.expires_at)
        self.orphans.pop(entry.path, None)
        if entry.lease_name is not None:
            self._watch(entry)
        self.driver._poke.set()  # its expiry needs scheduling

    def drop(self, path: str) -> HeldNode | None:
        return self.entries.pop(path, None)

    def _watch(self, entry: HeldNode) -> None:
        self.driver.zk.watch_node(entry.path, partial(self._event, entry))

    def _event(self, entry: HeldNode, kind: str) -> None:
        if self.entries.get(entry.path) is not entry:
            return
        if kind in ("DELETED", "MISSING"):
            entry.gone = True
            self.driver._renew_now()  # refused at once
        elif kind == "FAILED" or (kind == "NONE" and self.driver._suspended):
            self._unwatched.append(entry)  # set again on reconnect
        elif kind != "NONE":  # written: watch again
            self._watch(entry)

    def rewatch(self) -> None:
        pending, self._unwatched = self._unwatched, []
        for entry in pending:
            if self.entries.get(entry.path) is entry:
                self._watch(entry)

    async def renew(self, refs: Sequence[tuple[str, LeaseRef]]) -> list[ExtendResult]:
        """Renew these nodes (path, lease): one ``sync`` for them all."""
        driver = self.driver
        t_send = driver.clock.now()
        try:
            await driver._call_now("renewal", driver.zk.sync)
        except Exception as exc:
            error = driver.errors.unavailable("renewal failed", exc)
            return [error] * len(refs)
        session = driver.zk.session_id
        out: list[ExtendResult] = []
        for path, ref in refs:
            entry = self.entries.get(path)
            if entry is None or entry.owner != ref.owner or entry.token != ref.token:
                out.append(Refused("not held by this owner (its node is gone)"))
            elif entry.gone:
                self.drop(path)
                out.append(Refused("its node was deleted at the server"))
            elif entry.session != session:
                self.drop(path)
                out.append(Refused("the ZooKeeper session its node was made on ended"))
            else:
                entry.ttl = ref.ttl
                entry.expires_at = max(entry.expires_at, t_send + ref.ttl)
                out.append(True)
        return out

    async def delete(self, path: str, czxid: int | None, owner: str) -> bool:
        """Delete our node ``path`` (guarded: see the module), forgetting it here first;
        True if it was there and ours. A delete that fails is retried by housekeeping."""
        entry = self.entries.get(path)
        if entry is not None and entry.owner == owner and czxid in (None, entry.czxid):
            czxid = entry.czxid
            self.drop(path)
        else:
            entry = None
        try:
            return await self._delete(path, czxid, owner)
        except BaseException:
            if entry is not None:
                self.orphans[path] = (czxid, owner)
                self.driver._poke.set()
            raise

    async def _delete(self, path: str, czxid: int | None, owner: str) -> bool:
        call, zk = self.driver._call, self.driver.zk
        guard = self.guards.get(path)

        async def read() -> tuple[bytes, Stat, int | None]:
            """The node, and its guard's data version read just before it (None: no guard)."""
            if guard is None:
                return (*await zk.get(path), None)
            (kept, node), _ = await zk.read_many([guard, path])
            if isinstance(node, BaseException):
                raise node
            if isinstance(kept, NoNodeError):  # a node granted by an asynclock before guards
                return (*node, None)
            if isinstance(kept, BaseException):
                raise kept
            return (*node, kept[1].version)

        try:
            data, stat, version = await call("release", read)
            if czxid is not None and stat.czxid != czxid:
                return False
            if czxid is None and decode_data(data)[0] != owner:
                return False
            if guard is None or version is None:
                await call("release", partial(zk.delete, path, stat.version))
                return True
            ops = [Op("check", guard, version=version), Op("delete", path, version=stat.version)]
            # Refused (the guard moved: the path was granted again since our read, so the
            # node there is another holder's; or the node is gone): not ours to delete.
            done = await call("release", partial(zk.multi, ops))
            return done.failed_at is None
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, (NoNodeError, BadVersionError)):
                return False
            raise

    def expires(self, entry: HeldNode, at: float) -> None:
        """``entry`` now expires ``at``, maybe earlier than before."""
        entry.expires_at = at
        self._due = min(self._due, at)

    def expire(self, now: float) -> float:
        """Forget every node whose ttl has passed since its last confirmed renewal (and
        delete it at the server later); returns when the next one is due. O(1) until
        the earliest can have passed."""
        if now < self._due:
            return self._due
        due = math.inf
        for path, entry in list(self.entries.items()):
            if now >= entry.expires_at:
                self.drop(path)
                self.orphans[path] = (entry.czxid, entry.owner)
            else:
                due = min(due, entry.expires_at)
        self._due = due
        return due

    async def clean(self) -> bool:
        """Delete the orphans; False if one failed (try again soon)."""
        ok = True
        for path, (czxid, owner) in list(self.orphans.items()):
            try:
                await self._delete(path, czxid, owner)
            except Exception:
                ok = False
            else:
                if self.orphans.get(path) == (czxid, owner):
                    del self.orphans[path]
        return ok

    def lose_all(self, why: str, *, keep: bool) -> None:
        """Every node is lost (the session ended, or may have): tell the core. ``keep``:
        the session may come back, so delete them then."""
        for path, entry in list(self.entries.items()):
            del self.entries[path]
            if keep:
                self.orphans[path] = (entry.czxid, entry.owner)
            if entry.lease_name is not None:
                self.driver._notify_lost(entry.lease_name, entry.owner, why)
        if not keep:
            self.orphans.clear()  # the session's nodes went with it
            self._unwatched.clear()

    def __len__(self) -> int:
        return len(self.entries)
