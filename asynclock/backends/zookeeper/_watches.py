"""The ZooKeeper driver's watches: a queued waiter's on the node in front of it (armed
again at every wake-up: a watch fires once, and a write to that node fires it as
"changed"), and one on each held node of ours (deleted behind our back: lost); and the
walk of the tree that lists the names held; deletes of our own nodes."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from ..._core.driver import Driver
from ..._core.exceptions import BackendUnavailable
from .._common.coalesce import Coalesced
from . import _paths
from ._kazoo import NoAuthError, NoNodeError, Op, Zk
from ._nodes import HeldLocks, Node

T = TypeVar("T")

#: The most deletes one release ``multi`` carries (each a path of ~100 bytes: far below
#: ZooKeeper's 1 MB request limit, ``jute.maxbuffer``).
DELETES = 500


@dataclass(frozen=True, slots=True)
class Behind:
    """A queued waiter's :attr:`~asynclock._core.driver.Busy.cursor`: its owner and the
    node in front of it (the one it watches)."""

    owner: str
    path: str


class Watches(Driver):
    """The watch half of :class:`~asynclock.backends.zookeeper.driver.ZooKeeperDriver`."""

    zk: Zk
    prefix: str
    held: HeldLocks
    _suspended: bool
    #: node in front of a queued waiter -> the watch armed on it (until it fires)
    _armed: dict[str, Callable[[Any], None]]
    #: node in front of queued waiters -> (name, owner) of each: the only waiters its
    #: deletion wakes (one per node while the queue holds still: no herd)
    _behind: dict[str, set[tuple[str, str]]]
    #: held nodes whose watch could not be set (connection down): set again later
    _unwatched: dict[str, Node]

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        raise NotImplementedError  # pragma: no cover - the driver's

    async def watch(self, name: str, cursor: object = None) -> bool:
        if not isinstance(cursor, Behind):
            return False
        return await self._arm(name, cursor.path, cursor.owner)

    async def _arm(self, name: str, path: str, owner: str) -> bool:
        """Watch ``path``, the node in front of the waiter ``owner`` of ``name``, unless a
        watch on it is armed already (it fires once; then this arms it again). True if it
        is gone."""
        self._behind.setdefault(path, set()).add((name, owner))
        if path in self._armed:
            return False
        loop = self.zk._loop

        def fired(event: Any) -> None:  # kazoo's thread
            if loop is not None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._fired, name, path, fired)

        self._armed[path] = fired
        try:
            there = await self._call("watch", partial(self.zk.exists_watched, path, fired))
        except BaseException:
            self._disarm(path, fired)
            raise
        if not there:
            self._disarm(path, fired)
        return not there

    def _disarm(self, path: str, fired: Callable[[Any], None]) -> None:
        if self._armed.get(path) is fired:
            del self._armed[path]

    def _fired(self, name: str, path: str, fired: Callable[[Any], None]) -> None:
        self._disarm(path, fired)
        self._wake_behind(path)  # the waiter looks again, and arms a watch again

    def _wake_behind(self, path: str) -> None:
        """``path`` was deleted (or written): wake the local waiters queued right behind
        it, and only them (each looks again, and arms a watch on its new predecessor)."""
        for name, owner in self._behind.pop(path, ()):
            self._wake(name, owner)

    def _watch_held(self, owner: str, node: Node) -> None:
        """Watch a held node of ours: deleted behind our back (``break``, an operator),
        the next renewal (made at once) is refused."""
        self.zk.watch_node(node.path, partial(self._held_event, owner, node))

    def _held_event(self, owner: str, node: Node, kind: str) -> None:
        if self.held.get(owner) is not node or node.releasing:
            return
        if kind in ("DELETED", "MISSING"):
            node.gone = True
            self._renew_now()  # refused at once, as a renewal that found it gone
        elif kind == "FAILED" or (kind == "NONE" and self._suspended):
            self._unwatched[owner] = node  # set again on reconnect
        elif kind != "NONE":  # written (CHANGED): watch again
            self._watch_held(owner, node)

    async def _delete_orphan(self, orphan: str | tuple[str, str]) -> None:
        if isinstance(orphan, str):
            await self._delete(orphan)
            return
        lock, owner = orphan
        try:
            children = await self._call("listing", partial(self.zk.children, lock))
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, NoNodeError):
                return
            raise
        for child in children:
            if child.startswith(owner[:32] + _paths.MARK):
                await self._delete(f"{lock}/{child}")

    _releases: Coalesced[str, bool] | None = None

    async def _delete_held(self, path: str) -> bool:
        """Delete a held node of ours (a release); False if it was gone already. Deletes
        made while one is in flight go out together, one ``multi`` per batch (issue 45:
        100,000 blocks exiting at once, one delete per round trip through kazoo's thread,
        took 278 s)."""
        releases = self._releases
        if releases is None:
            what = f"{self.display}: release"
            releases = self._releases = Coalesced(
                self._delete, self._delete_many, limit=DELETES, what=what
            )
        return await releases(path, path)

    async def _delete_many(self, paths: list[str]) -> list[bool | BaseException]:
        """One ``multi`` deleting every path; if one is gone already (the transaction then
        applies nothing), each is deleted on its own."""
        done = await self._call("release", partial(self.zk.multi, [Op("delete", p) for p in paths]))
        if done.failed_at is None:
            return [True] * len(paths)
        answers: list[bool | BaseException] = []
        for path in paths:
            try:
                answers.append(await self._delete(path))
            except Exception as exc:
                answers.append(exc)
        return answers

    async def _delete(self, path: str) -> bool:
        """Delete a node of ours; False if it was gone already."""
        try:
            await self._call("delete", partial(self.zk.delete, path))
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, NoNodeError):
                return False
            raise
        return True

    async def names(self) -> list[str]:
        return await self.names_under("")

    async def names_under(self, prefix: str) -> list[str]:
        """The names starting with ``prefix``: a walk of the nodes whose names can lead
        there (one listing per node walked), not of every name's node. A partition group
        listed its members and partitions so on every balance, walking every lock name on
        the server: with a thousand other names, a member took 15 s to join (the suite's
        ZooKeeper partition test, timed out beside other tests' names)."""

        def leads_there(path: str) -> bool:
            name = _paths.name_of(self.prefix, path)
            return name.startswith(prefix) or prefix.startswith(name + "/")

        found: list[str] = []
        top = self.prefix or "/"
        pending = [top]
        while pending:
            path = pending.pop()
            try:
                children = await self._call("listing", partial(self.zk.children, path))
            except BackendUnavailable as exc:
                if isinstance(exc.__cause__, (NoNodeError, NoAuthError)):
                    continue
                raise
            base = "" if path == "/" else path
            held, names = await self._numbered(base, _paths.contenders(children))
            if path != top and held:
                name = _paths.name_of(self.prefix, path)
                if name.startswith(prefix):
                    found.append(name)
            pending += [p for p in names if leads_there(p)]
            for child in children:
                if _paths.sequence(child) is not None or (base == "" and child == "zookeeper"):
                    continue
                reserved = path == top and child.startswith(_paths.RESERVED)  # permits, rw
                if not reserved and leads_there(f"{base}/{child}"):
                    pending.append(f"{base}/{child}")
        return sorted(found)

    async def _numbered(self, base: str, numbered: list[str]) -> tuple[bool, list[str]]:
        """Of the children of ``base`` whose names end in a sequence number: is one of them
        a contender (ephemeral: a lock protocol's node), and the paths of the others (a
        lock name's own node: ``invoice:1700000000``, a partition member's id ending in ten
        digits; these were taken for contenders and their names never listed)."""
        if not numbered:
            return False, []
        paths = [f"{base}/{child}" for child in numbered]

        async def read() -> list[tuple[bytes, Any] | BaseException]:
            nodes, _ = await self.zk.read_many(paths)
            for node in nodes:
                if isinstance(node, BaseException) and not isinstance(node, NoNodeError):
                    raise node
            return nodes

        nodes = await self._call("listing", read)
        held = False
        names: list[str] = []
        for child_path, node in zip(paths, nodes, strict=True):
            if isinstance(node, BaseException):
                continue  # released since the listing
            if node[1].ephemeral:
                held = True
            else:
                names.append(child_path)
        return held, names


__all__ = ("Behind", "Watches")
