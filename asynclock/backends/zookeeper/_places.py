"""Semaphore waiters' places in ZooKeeper: the queue of issue 42 (first come, first
served; the rules are :mod:`asynclock._core.permit_store`'s), under ``<semaphore>/q``.

* ``q/<owner>-<sequence>`` — one EPHEMERAL_SEQUENTIAL node per queued waiter (data: its
  owner and its place's ttl, :func:`~asynclock._core.permit_store.place_ttl`), on the
  driver's one session: the order is the sequence, and a dead *session* removes it.
* **Arrivals** are counted in ``q``'s data version: a place is created in one ``multi``
  with a ``set`` of ``q`` (a ``check`` compares data versions only, and a child's create
  changes ``q``'s cversion, not its version). An asker without a place counts every place
  listed at version V, and its grant's ``multi`` has ``check(q, V)``: a waiter that arrived
  since the listing cannot be overtaken. An asker with a place counts the places listed
  ahead of it when it took it (a later arrival is behind it): no check, and that list only
  shrinks (sequence numbers are never reused).
* **Lapse** by the server's clock: each ask of a queued waiter ``set``\\ s its place (its
  stat's mtime is the leader's clock: the asker's "now"; a gap above the place's ttl since
  the previous ask means the place had lapsed: it is deleted and a new one taken at the
  end); an asker without a place learns "now" from the ``set`` of ``q`` it sends with its
  listing. A place ahead whose mtime is more than its ttl before "now" has lapsed: a grant
  deletes it in its own ``multi`` at the data version read (a place refreshed meanwhile
  fails the grant, which looks again), and an ask that is not granted deletes the lapsed
  places it saw the same way.
* **Poll cost** (a queued waiter, every ≤ 0.5 s): one round trip, ``set`` of its place +
  ``exists(p)`` (the number of live permits: O(1)) + ``get`` of the place just ahead of it.
  The places ahead are listed once per place taken (O(W) for W waiters), not per poll; only
  when a permit is free and that nearest place has gone or lapsed are the next ones read,
  nearest first, one round trip per batch, until enough live ones are found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ..._core.exceptions import BackendUnavailable
from ..._core.permit_store import MAX_PLACE_TTL, place_ttl
from ._kazoo import Multi, NoNodeError, Op, Request, Stat
from ._nodes import decode_data, encode_data
from ._paths import node_name

if TYPE_CHECKING:
    from ._sem import ZkPermits


@dataclass(slots=True)
class Place:
    """A queued waiter's place, as this process last wrote it."""

    path: str
    #: The server's clock (ms) at its last write (its creation or the last ask).
    mtime: int
    ttl_ms: int
    #: The places ahead of it when it was taken, nearest last (only ever shrinks).
    ahead: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Verdict:
    """May the asker be granted a permit now, and what the grant's ``multi`` must also do
    (check the queue, delete the lapsed places ahead and the asker's own)."""

    go: bool
    ops: list[Op] = field(default_factory=list)
    #: Places ahead of the asker's as last seen (gone ones included: at most), if known.
    ahead: int | None = None


@dataclass(slots=True)
class _Look:
    """What one look saw: free permits, the places ahead (queue order), the server's now
    (ms; None: not learned), the grant's check of q and delete of the asker's place, and
    the nearest place ahead as read (or None)."""

    free: int
    ahead: list[str]
    now: int | None
    check: list[Op]
    own: list[Op] = field(default_factory=list)
    first: Any = None


def _sequence(name: str) -> int:
    return int(name[-10:]) if name[-10:].isdigit() else -1


class Places:
    """One semaphore's queue of places (see the module)."""

    def __init__(self, store: ZkPermits) -> None:
        self.store = store
        self.driver = store.driver
        self.path = store.base + "/q"
        #: owner -> its place (a waiter of this store).
        self.mine: dict[str, Place] = {}
        #: owners whose place's creation was sent and not answered (interrupted).
        self.creating: set[str] = set()
        #: The limit node's data version as the last look read it (None: not read).
        self.limit_version: int | None = None

    async def _send(self, requests: list[Request]) -> list[Any]:
        zk = self.driver.zk
        return await self.driver._call(
            f"queue of semaphore {self.store.name!r}", partial(zk.pipeline, requests)
        )

    def _listed(self, version: int, children: list[str]) -> list[str]:
        """The listed places' paths in queue order; kept as the name's snapshot."""
        order = sorted(children, key=_sequence)
        self.driver.nodes.queues[self.store.name] = (version, tuple(order))
        return [f"{self.path}/{c}" for c in order]

    def forget(self) -> None:
        """The queue changed since it was listed: list it at the next ask."""
        self.driver.nodes.queues.pop(self.store.name, None)

    async def judge(self, owner: str, ttl: float, queue: bool, fast: bool) -> Verdict:
        """One look at the queue for ``owner``'s ask (see the module). An asker without a
        place reads (no write) and, if it is not let through and ``queue``, takes a place
        and looks again; a queued asker keeps its place. ``fast``: trust a snapshot of an
        empty queue (the grant's ``check`` finds out if a waiter came since)."""
        take, self.limit_version = False, None
        for _ in range(4):
            snapshot = self.driver.nodes.queues.get(self.store.name)
            if fast and owner not in self.mine and snapshot is not None and not snapshot[1]:
                return Verdict(True, [Op("check", self.path, version=snapshot[0])])
            look = await self._look(owner, ttl, take)
            if look is None:
                continue
            verdict = await self._decide(look, queue)
            if verdict is None:
                continue
            if verdict.go or not queue or owner in self.mine:
                return verdict
            take, fast = True, False
        return Verdict(False)

    async def _decide(self, look: _Look, queue: bool) -> Verdict | None:
        """Let through if fewer live places are ahead than permits are free (None: the
        queue changed, look again). An asker without a place that will take one
        (``queue``) reads the places ahead only once it has."""
        if look.free <= 0:
            return Verdict(False, ahead=len(look.ahead))
        ahead, check = look.ahead, look.check
        if len(ahead) < look.free:
            return Verdict(True, [*check, *look.own])
        now = look.now
        if now is None:
            if queue:
                return Verdict(False, ahead=len(look.ahead))
            # The server's now: a set of q, if no waiter came since the listing.
            stat = (await self._send([("set", self.path, b"", check[0].version)]))[0]
            if isinstance(stat, BaseException):
                self.forget()
                return None
            now, check = stat.mtime, [Op("check", self.path, version=stat.version)]
        live, lapsed, gone = await self._probe(ahead, look.free, now, look.first)
        for path in gone:
            ahead.remove(path)
        if live >= look.free:
            for path in await self.drop(lapsed):
                ahead.remove(path)
            return Verdict(False, ahead=len(look.ahead))
        deletes = [Op("delete", p, version=v) for p, v in lapsed]
        return Verdict(True, [*check, *deletes, *look.own])

    async def _look(self, owner: str, ttl: float, queue: bool) -> _Look | None:
        """Read the permits' count and the places ahead of ``owner`` (keeping or taking
        its place if it has one or ``queue``): one round trip; None: look again."""
        ttl_ms = round(place_ttl(ttl) * 1000)
        data = encode_data(owner, ttl_ms / 1000)
        place = self.mine.get(owner)
        requests: list[Request] = []
        if place is not None:  # keep it: the set's mtime is the server's now
            requests.append(("set", place.path, data, -1))
            requests.extend(("get", p) for p in place.ahead[-1:])
        elif queue:  # take one at the end, then see who is ahead
            self.creating.add(owner)
            prefix = f"{self.path}/{node_name(owner)}-"
            make = Op("create", prefix, data, ephemeral=True, sequence=True)
            requests += [("multi", [make, Op("set", self.path)]), ("children", self.path)]
        else:  # every place at q's version (no write: "now" only if it is needed)
            requests += [("exists", self.path), ("children", self.path)]
        requests += [("exists", self.store.limit_path), ("exists", self.store.permits)]
        answers = await self._send(requests)
        limit, permits = answers[-2], answers[-1]
        for answer in (limit, permits):
            if isinstance(answer, BaseException):
                raise answer
        self.limit_version = None if limit is None else limit.version
        free = self.store.limit - (0 if permits is None else permits.children)
        if place is not None:
            stat = answers[0]
            if isinstance(stat, NoNodeError):  # lapsed, and deleted by another's ask
                del self.mine[owner]
                return None
            if isinstance(stat, BaseException):
                raise stat
            if stat.mtime - place.mtime > place.ttl_ms:  # lapsed before this ask
                del self.mine[owner]
                await self.drop([(place.path, stat.version)])
                return None
            place.mtime = stat.mtime
            first = answers[1] if place.ahead else None
            return _Look(free, place.ahead, stat.mtime, [], [Op("delete", place.path)], first)
        made, listed = answers[0], answers[1]
        if isinstance(made, Multi):  # our place: (its path, the set of q)
            self.creating.discard(owner)
            made = made.error if made.failed_at is not None else made.results
        if made is None or isinstance(made, NoNodeError):  # the queue's node: made once
            await self.driver._call(
                "semaphore setup", partial(self.driver.zk.ensure_path, self.path)
            )
            return None
        for answer in (made, listed):
            if isinstance(answer, BaseException):
                raise answer
        if isinstance(made, Stat):
            ahead = self._listed(made.version, listed)
            return _Look(free, ahead, None, [Op("check", self.path, version=made.version)])
        stat = made[1]
        ahead = self._listed(stat.version, listed)
        path = f"{self.path}/{made[0].rsplit('/', 1)[1]}"
        ahead = [p for p in ahead if _sequence(p) < _sequence(path)]
        self.mine[owner] = Place(path, stat.mtime, ttl_ms, ahead)
        return _Look(free, ahead, stat.mtime, [], [Op("delete", path)])

    async def _probe(
        self, ahead: list[str], free: int, now: int, first: Any
    ) -> tuple[int, list[tuple[str, int]], list[str]]:
        """Read the places ahead, nearest first, until ``free`` live ones are found or all
        are read: (how many live, the lapsed ones (path, data version), the gone ones)."""
        live, lapsed, gone = 0, [], []
        order = ahead[::-1]
        known = {} if first is None else {order[0]: first}
        at = 0
        while live < free and at < len(order):
            batch = order[at : at + free - live]
            unread = [p for p in batch if p not in known]
            if unread:
                got = await self._send([("get", p) for p in unread])
                known.update(zip(unread, got, strict=True))
            for path in batch:
                got = known[path]
                if isinstance(got, NoNodeError):
                    gone.append(path)
                    continue
                if isinstance(got, BaseException):
                    raise got
                data, stat = got
                ttl = decode_data(data)[1]
                if now - stat.mtime > round(1000 * (MAX_PLACE_TTL if ttl is None else ttl)):
                    lapsed.append((path, stat.version))
                else:
                    live += 1
            at += len(batch)
        return live, lapsed, gone

    async def drop(self, places: list[tuple[str, int]]) -> list[str]:
        """Delete these places at these data versions (lapsed: one refreshed since is
        kept); the ones gone now."""
        if not places:
            return []
        answers = await self._send([("delete", p, v) for p, v in places])
        return [
            p
            for (p, _), a in zip(places, answers, strict=True)
            if a is True or isinstance(a, NoNodeError)
        ]

    def granted(self, owner: str) -> None:
        self.mine.pop(owner, None)
        self.creating.discard(owner)

    async def withdraw(self, owner: str) -> None:
        place = self.mine.pop(owner, None)
        doomed = [] if place is None else [place.path]
        if owner in self.creating:  # a creation whose answer was lost: find it by name
            try:
                children = await self._send([("children", self.path)])
            except BackendUnavailable:
                children = [[]]
            prefix = node_name(owner) + "-"
            if not isinstance(children[0], BaseException):
                doomed += [f"{self.path}/{c}" for c in children[0] if c[:-10] == prefix]
            self.creating.discard(owner)
        await self.drop([(p, -1) for p in doomed])
