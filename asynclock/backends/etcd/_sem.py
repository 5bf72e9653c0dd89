"""Counting semaphores in etcd (``backend.semaphore(name, limit)``; the rules are
:mod:`asynclock._core.permit_store`'s). A semaphore ``name`` is, under
``<prefix>\\x00asynclock.sem/<name>/`` (asynclock's reserved prefix, so no lock's keys,
``<prefix><lock name>/<lease>``, ever mix with them):

* ``p/<slot>`` — one key per live permit (slot 0 .. limit-1, in decimal; the value is the
  owner), put on the driver's session of its ttl (:mod:`._leased`: a crashed process's
  permits go with its session, a permit the core stops renewing is deleted locally);
* ``limit`` — the limit of the live permits (no lease, kept: one small key per name);
* ``q/<owner>`` — one key per queued waiter's *place* (first come, first served: see
  :mod:`asynclock._core.permit_store`), its position the key's create revision, put on a
  lease of its own of ``ceil(place_ttl(ttl))`` seconds. Each later ask of the waiter keeps
  it by a keep-alive of that lease (never a new put: the position stays), so a place lapses
  at the server once its waiter stops asking, although its process (and its sessions) may
  live on; a withdrawal revokes the lease (the key goes with it). etcd makes it lapse
  later than ``place_ttl``: it grants whole seconds, at least its minimum lease TTL (1.5
  election timeouts, rounded up: 2 s with etcd's defaults), and sweeps expired leases every
  0.5 s. Measured: a place of ``place_ttl`` 1 s goes 1.0-1.5 s after the last ask with a
  500 ms election timeout (the tests'), 2.0-2.5 s with etcd's defaults; 1.2-2 s: 2.0-2.5 s.

* **Grant**: one txn ``create_revision(p/<slot>) == 0 and value(limit) == limit`` → put
  the permit; else read the limit and the live slots (keys only), and try again at once on
  a slot the reply shows free. The create-if-absent on one key per slot keeps at most
  ``limit`` permits live. **In turn**: the first try also compares that no place is ahead
  of the asker's (``create_revision`` of every ``q/`` key at or above its own; no ``q/``
  key at all if it has none) and deletes its place; when that fails, the same txn's reply
  (the limit, the live slots, the places, at one revision ``r``) tells whether fewer places
  are ahead than permits are free, and the next try compares that the read still holds: its
  place unchanged (none: no ``q/`` key created after ``r``) and, if places were ahead, no
  ``p/`` key created after ``r``. Deletions only let more in. A waiting poll not in turn is
  that txn and one keep-alive of its place's lease (the first: a lease grant and a put).
* **Limit**: the first grant, or one that finds no live permit, sets ``limit`` in the same
  txn as its permit (``no key under p/`` as its compare); while permits of another limit
  are live, a grant answers ``OtherLimit`` (atomic: no race between two limits).
* **Token**: the permit key's create revision, etcd's cluster-wide revision at the grant:
  strictly above every token granted before, for this slot and every other (G2).

``/`` and ``%`` in ``<name>`` are escaped (``%2F``, ``%25``): one segment, so the keys of
``x/r`` never fall in the ranges ``x`` lists.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..._core.driver import ExtendResult, LeaseRef
from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from ..._core.permit_store import (
    Answer,
    Full,
    Granted,
    OtherLimit,
    PermitStore,
    permit_holder,
    place_ttl,
)
from ..._core.semaphore import LEASE_PREFIX
from . import _proto as pb
from ._kv import created_at, lease_left, live_left
from ._leased import Leased, Renewal, name_segment
from .client import EtcdClient, EtcdError, prefix_end

if TYPE_CHECKING:
    from .driver import EtcdDriver

#: A grant's attempts in one call before it answers Full (the core backs off and retries).
ATTEMPTS = 4


def semaphore_prefix(prefix: str, name: str) -> bytes:
    """Where the keys of semaphore ``name`` are (see the module)."""
    return f"{prefix}\x00asynclock.sem/{name_segment(name)}/".encode("utf-8", "surrogatepass")


def permits_prefix(prefix: str, name: str) -> bytes:
    """Where the permits of semaphore ``name`` are (see the module)."""
    return semaphore_prefix(prefix, name) + b"p/"


def _all_created(prefix: bytes, result: int, revision: int) -> Any:
    """The compare that every key under ``prefix`` has a create revision ``result``
    (equal, greater, less) than ``revision`` (true when there is no key, whose create
    revision is 0)."""
    return pb.Compare(
        result=result,
        target=pb.CMP_TARGET_CREATE,
        key=prefix,
        range_end=prefix_end(prefix),
        create_revision=revision,
    )


@dataclass(eq=False)
class _Place:
    """A waiter's place in the queue: its own etcd lease, kept alive by each ask."""

    lease: int
    #: The place key's create revision (its position), once seen.
    rev: int | None = None


class EtcdPermits(PermitStore):
    """A semaphore's permits in an etcd cluster (see the module)."""

    renew_chunk = None  # one keep-alive and one key listing per session, whatever the count

    def __init__(self, driver: EtcdDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.client = driver.client
        self.leased = driver.leased
        self.display = driver.display
        self.base = permits_prefix(driver.prefix, name)
        self.limit_key = semaphore_prefix(driver.prefix, name) + b"limit"
        self.queue_base = semaphore_prefix(driver.prefix, name) + b"q/"
        #: owner -> its place in the queue, taken by this store.
        self._places: dict[str, _Place] = {}
        self._lease_name = LEASE_PREFIX + name

    def _key(self, slot: int) -> bytes:
        return self.base + b"%d" % slot

    def _slots(self, kvs: Iterable[Any]) -> set[int]:
        found = (kv.key[len(self.base) :] for kv in kvs)
        return {int(s) for s in found if s.isdigit()}

    async def withdraw(self, owner: str) -> None:
        place = self._places.pop(owner, None)
        if place is not None:
            await self._drop_lease(place.lease)  # (its place key goes with it)

    async def grant(self, owner: str, ttl: float, *, queue: bool = False) -> Answer:
        trying: list[int] = []
        try:
            answer = await self._grant(owner, ttl, trying)
        finally:
            self.trying.difference_update(trying)  # a granted slot is in self.slots by now
        if isinstance(answer, Full) and queue:
            await self._keep_place(owner, ttl)
        return answer

    async def _grant(self, owner: str, ttl: float, trying: list[int]) -> Answer:
        value, limit = owner.encode(), b"%d" % self.limit
        me = self.queue_base + value
        same_limit = pb.Compare(
            result=pb.CMP_EQUAL, target=pb.CMP_TARGET_VALUE, key=self.limit_key, value=limit
        )
        none_live = _all_created(self.base, pb.CMP_EQUAL, 0)
        look = [
            pb.RequestOp(request_range=pb.RangeRequest(key=self.limit_key)),
            pb.RequestOp(
                request_range=pb.RangeRequest(
                    key=self.base, range_end=prefix_end(self.base), keys_only=True
                )
            ),
            pb.RequestOp(
                request_range=pb.RangeRequest(
                    key=self.queue_base, range_end=prefix_end(self.queue_base), keys_only=True
                )
            ),
        ]
        leave_queue = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=me))
        # First try as if no place were ahead of ours (none at all, if we have none).
        place = self._places.get(owner)
        if place is not None and place.rev is not None:
            in_turn = [
                created_at(me, place.rev),
                _all_created(self.queue_base, pb.CMP_GREATER, place.rev - 1),
            ]
        else:
            in_turn = [_all_created(self.queue_base, pb.CMP_EQUAL, 0)]
        set_limit = False  # (the limit key is seen wrong and no permit live: set it)
        slot = self.guess_slot((), trying)
        for _ in range(ATTEMPTS):
            if slot is None:
                return Full()
            session = await self.leased.session(ttl)
            key = self._key(slot)
            put = pb.RequestOp(
                request_put=pb.PutRequest(key=key, value=value, lease=session.lease_id)
            )
            if set_limit:
                limit_put = pb.RequestOp(request_put=pb.PutRequest(key=self.limit_key, value=limit))
                compare, success = [none_live, *in_turn], [put, limit_put, leave_queue]
            else:
                compare, success = [created_at(key, 0), same_limit, *in_turn], [put, leave_queue]
            request = pb.TxnRequest(compare=compare, success=success, failure=look)
            reply: Any = await self.leased.txn(session, request)
            if reply is None:
                continue  # the session's lease expired: again on a new one
            if reply.succeeded:
                self._places.pop(owner, None)  # (its lease, keyless now, lapses unasked)
                rev = reply.header.revision
                expires_at = self.leased.now() + ttl
                self.leased.add(
                    Leased(key, value, owner, rev, rev, session, ttl, expires_at, self._lease_name)
                )
                return Granted(slot, rev)
            limits = reply.responses[0].response_range.kvs
            held = bytes(limits[0].value) if limits else b""
            live = self._slots(reply.responses[1].response_range.kvs)
            if held != limit and live and held.isdigit():
                return OtherLimit(int(held))
            set_limit = held != limit
            # First come, first served: our turn only if fewer places are ahead of ours
            # (all of them, if we have none) than permits are free.
            places = reply.responses[2].response_range.kvs
            mine = next((kv.create_revision for kv in places if kv.key == me), None)
            ahead = sum(1 for kv in places if mine is None or kv.create_revision < mine)
            if place is not None and mine is not None:
                place.rev = mine
            if len(live) + ahead >= self.limit:
                return Full(ahead=ahead)
            in_turn = self._still_in_turn(me, mine, ahead, reply.header.revision)
            if slot in live:  # (else it was the limit or the queue: the slot is still free)
                slot = self.guess_slot(live, trying)
        return Full()

    def _still_in_turn(self, me: bytes, mine: int | None, ahead: int, read: int) -> list[Any]:
        """The compares that keep a grant in turn as the read at revision ``read`` saw it:
        no place taken since ahead of ours (ours is still there; if we have none, no new
        place at all) and, if places were ahead, no permit granted since (it could be one
        of theirs, or an overtaker's: the count we were let in by would be stale).
        Deletions (releases, grants' places, lapses, withdrawals) only let more in."""
        newer = read + 1
        guards = [
            created_at(me, mine)
            if mine is not None
            else _all_created(self.queue_base, pb.CMP_LESS, newer)
        ]
        if ahead:
            guards.append(_all_created(self.base, pb.CMP_LESS, newer))
        return guards

    async def _keep_place(self, owner: str, ttl: float) -> None:
        """Keep ``owner``'s place for ``place_ttl(ttl)`` more seconds (a keep-alive of its
        own lease: its key, and so its position, unchanged), or take one at the end of
        the queue on a new lease if it has none or it lapsed."""
        place = self._places.get(owner)
        if place is not None:
            ttls = await self.client.keep_alive([place.lease])
            if ttls.get(place.lease, 0) > 0:
                return
            del self._places[owner]  # lapsed (its key deleted with its lease)
        reply = await self.client.grant(math.ceil(place_ttl(ttl)))
        if reply.error or reply.TTL <= 0:
            raise BackendUnavailable(f"{self.display}: lease grant refused: {reply.error}")
        # Known before the put: a withdrawal revokes it whatever happened to the put.
        place = self._places[owner] = _Place(reply.ID)
        me = self.queue_base + owner.encode()
        put = pb.PutRequest(key=me, value=owner.encode(), lease=place.lease)
        taken: Any = await self.client.txn(
            pb.TxnRequest(
                success=[
                    pb.RequestOp(request_put=put),
                    pb.RequestOp(request_range=pb.RangeRequest(key=me, keys_only=True)),
                ]
            )
        )
        kvs = taken.responses[1].response_range.kvs
        if kvs and self._places.get(owner) is place:
            place.rev = kvs[0].create_revision  # (a put keeps a key's create revision)

    async def _drop_lease(self, lease: int) -> None:
        try:
            await self.client.revoke(lease)
        except EtcdError as exc:
            if exc.code != "NOT_FOUND":  # (lapsed already)
                raise

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        refs = []
        for ref in leases:
            slot = self.slots.get(ref.owner)
            key = b"" if slot is None else self._key(slot)
            refs.append(Renewal(key, ref.owner, ref.token, ref.ttl))
        return await self.leased.renew(refs)

    async def release_permit(self, owner: str, slot: int | None, token: int | None) -> bool:
        if slot is not None:
            key = self._key(slot)
            entry = self.leased.entries.get(key)
            if entry is not None and entry.owner == owner and token in (None, entry.rev):
                return await self.leased.delete(key, entry.rev, owner)
            if token is not None:
                return await self.leased.delete(key, token, owner)
        # An interrupted grant (its reply may be lost): look for our key among them all.
        reply = await self.client.range(
            pb.RangeRequest(key=self.base, range_end=prefix_end(self.base))
        )
        for kv in reply.kvs:
            if bytes(kv.value) == owner.encode() and token in (None, kv.create_revision):
                return await self.leased.delete(kv.key, kv.create_revision, owner)
        return False

    async def holders(self) -> list[Holder]:
        get = pb.RangeRequest
        request = pb.TxnRequest(
            success=[
                pb.RequestOp(request_range=get(key=self.limit_key)),
                pb.RequestOp(request_range=get(key=self.base, range_end=prefix_end(self.base))),
            ]
        )
        reply: Any = await self.client.txn(request)  # one revision: the limit and the permits
        limits = reply.responses[0].response_range.kvs
        held = bytes(limits[0].value) if limits else b""
        limit = int(held) if held.isdigit() else None
        kvs = [
            kv for kv in reply.responses[1].response_range.kvs if kv.key[len(self.base) :].isdigit()
        ]
        left = await lease_left(self.client, kvs)
        found = []
        for kv in kvs:
            live, remaining = live_left(kv, left)
            if live:
                owner = bytes(kv.value).decode("utf-8", "replace")
                slot = int(kv.key[len(self.base) :])
                found.append(
                    permit_holder(self.name, slot, owner, kv.create_revision, remaining, limit)
                )
        return sorted(found, key=lambda h: h.slot or 0)


class HoldNames:
    """``Driver.hold_names`` of the etcd driver (a mixin: the driver stays small): the
    names with a live permit key (``p/``), or a writer, reader or intent key."""

    client: EtcdClient
    prefix: str

    async def hold_names(self) -> tuple[list[str], list[str]]:
        found: list[list[str]] = []
        for kind, live in (("sem", (b"p",)), ("rw", (b"w", b"r", b"i"))):
            start = f"{self.prefix}\x00asynclock.{kind}/".encode("utf-8", "surrogatepass")
            request = pb.RangeRequest(key=start, range_end=prefix_end(start), keys_only=True)
            names: dict[str, None] = {}
            for kv in (await self.client.range(request)).kvs:
                segment, _, rest = kv.key[len(start) :].partition(b"/")
                if rest.partition(b"/")[0] in live:  # (not the kept limit or epoch)
                    text = segment.decode("utf-8", "surrogatepass")
                    names[unquote(text, errors="surrogatepass")] = None  # name_segment's
            found.append(list(names))
        return found[0], found[1]
