"""Counting semaphores in etcd (``backend.semaphore(name, limit)``; the rules are
:mod:`asynclock._core.permit_store`'s).

A semaphore ``name`` is the keys ``<prefix>\\x00asynclock.sem/<name>/p/<slot>`` (slot
0 .. limit-1, in decimal), one per live permit, each put on the driver's session of its
ttl (:mod:`._leased`); the value is ``<limit>\\n<owner>``. Under asynclock's reserved
prefix, so no lock's keys (``<prefix><lock name>/<lease>``) ever mix with them.

* **Grant**: one txn ``create_revision(slot key) == 0`` → put it (and read every permit);
  else read every permit. The create-if-absent on one key per slot is what keeps at most
  ``limit`` permits live; a failed guess retries at once on a slot the reply shows free.
* **Token**: the slot key's create revision, etcd's cluster-wide revision at the grant:
  strictly above every token granted before, for this slot and every other (G2).
* **Limit**: each permit carries the limit it was granted under. A grant that sees a live
  permit of another limit refuses (``OtherLimit``); one that succeeded and then sees one
  (both raced in) deletes its own key and refuses, so of two racing limits the later
  grant (by revision) always gives way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._core.driver import ExtendResult, LeaseRef
from ..._core.permit_store import Answer, Full, Granted, OtherLimit, PermitStore
from ..._core.semaphore import LEASE_PREFIX
from . import _proto as pb
from ._kv import created_at
from ._leased import Leased, Renewal
from .client import prefix_end

if TYPE_CHECKING:
    from .driver import EtcdDriver

#: A grant's attempts in one call before it answers Full (the core backs off and retries).
ATTEMPTS = 3


def permits_prefix(prefix: str, name: str) -> bytes:
    """Where the permits of semaphore ``name`` are (see the module)."""
    return f"{prefix}\x00asynclock.sem/{name}/p/".encode("utf-8", "surrogatepass")


def _parse(kv: Any, base: bytes) -> tuple[int, int, str] | None:
    """(slot, limit, owner) of a permit key, None if the key is not one of ours."""
    limit, nl, owner = bytes(kv.value).partition(b"\n")
    slot = kv.key[len(base) :]
    if not nl or not slot.isdigit() or not limit.isdigit():
        return None
    return int(slot), int(limit), owner.decode("utf-8", "replace")


class EtcdPermits(PermitStore):
    """A semaphore's permits in an etcd cluster (see the module)."""

    renew_chunk = None  # one keep-alive and one key listing per session, whatever the count

    def __init__(self, driver: EtcdDriver, name: str, limit: int) -> None:
        super().__init__(name, limit)
        self.client = driver.client
        self.leased = driver.leased
        self.display = driver.display
        self.base = permits_prefix(driver.prefix, name)
        self._lease_name = LEASE_PREFIX + name

    def _key(self, slot: int) -> bytes:
        return self.base + b"%d" % slot

    def _read_all(self) -> Any:
        return pb.RequestOp(
            request_range=pb.RangeRequest(key=self.base, range_end=prefix_end(self.base))
        )

    async def grant(self, owner: str, ttl: float) -> Answer:
        value = b"%d\n" % self.limit + owner.encode()
        mine = set(self.slots.values())
        slot = next((s for s in range(self.limit) if s not in mine), 0)
        for _ in range(ATTEMPTS):
            session = await self.leased.session(ttl)
            key = self._key(slot)
            put = pb.PutRequest(key=key, value=value, lease=session.lease_id)
            request = pb.TxnRequest(
                compare=[created_at(key, 0)],
                success=[pb.RequestOp(request_put=put), self._read_all()],
                failure=[self._read_all()],
            )
            reply: Any = await self.leased.txn(session, request)
            if reply is None:
                continue  # the session's lease expired: again on a new one
            rev = reply.header.revision
            live: dict[int, int] = {}
            for kv in reply.responses[-1].response_range.kvs:
                parsed = _parse(kv, self.base)
                if parsed is not None and not (reply.succeeded and kv.create_revision == rev):
                    live[parsed[0]] = parsed[1]
            other = next((lim for lim in live.values() if lim != self.limit), None)
            if reply.succeeded:
                if other is not None:  # raced with a grant of another limit: give way
                    await self.leased.delete(key, rev, owner)
                    return OtherLimit(other)
                expires_at = self.leased.now() + ttl
                self.leased.add(
                    Leased(key, value, owner, rev, rev, session, ttl, expires_at, self._lease_name)
                )
                return Granted(slot, rev)
            if other is not None:
                return OtherLimit(other)
            free = [s for s in range(self.limit) if s not in live]
            if not free:
                return Full()
            slot = free[0]
        return Full()

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
            parsed = _parse(kv, self.base)
            mine = parsed is not None and parsed[2] == owner
            if mine and (token is None or kv.create_revision == token):
                return await self.leased.delete(kv.key, kv.create_revision, owner)
        return False
