"""Read-write locks in etcd (``backend.rwlock(name)``; the rules are
:mod:`asynclock._core.rw_store`'s). A read-write lock ``name`` is, under
``<prefix>\\x00asynclock.rw/<name>/`` (asynclock's reserved prefix: apart from every
lock's keys):

* ``w`` — the writer (value: its owner), on the driver's session of its ttl; its create
  revision is the writer epoch: etcd's cluster-wide revision, so it only rises (G2);
* ``e`` — the epoch: put (no lease, kept) in the same txn as ``w``, so its mod revision is
  the last writer's epoch, the token every reader gets (0 before the first write);
* ``r/<owner>`` — one key per reader; ``i/<owner>`` — one per waiting writer's intent;
  each on the session of its ttl (:mod:`._leased` expires them locally when the core stops
  renewing them or the writer stops waiting; a dead process's go with its session).

Each grant is one txn: a read needs no ``w`` and no key under ``i/``; a write needs no
``w`` and no key under ``r/`` (a compare over a range with ``create_revision == 0`` holds
exactly when the range is empty); a busy writer that waits puts its intent in the txn's
failure branch, so the intent and the refusal are one atomic step.

``/`` and ``%`` in ``<name>`` are escaped (``%2F``, ``%25``): one segment, so the keys of
``x/r`` never fall in the ranges ``x`` lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._core.driver import ExtendResult, LeaseRef
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
from . import _proto as pb
from ._kv import created_at, lease_left, live_left
from ._leased import Leased, Renewal, name_segment
from .client import prefix_end

if TYPE_CHECKING:
    from .driver import EtcdDriver


def rwlock_prefix(prefix: str, name: str) -> bytes:
    """Where the keys of read-write lock ``name`` are (see the module)."""
    return f"{prefix}\x00asynclock.rw/{name_segment(name)}/".encode("utf-8", "surrogatepass")


def _empty(prefix: bytes) -> Any:
    """A compare that holds when no key starts with ``prefix``."""
    return pb.Compare(
        result=pb.CMP_EQUAL,
        target=pb.CMP_TARGET_CREATE,
        key=prefix,
        range_end=prefix_end(prefix),
        create_revision=0,
    )


def _get(key: bytes) -> Any:
    return pb.RequestOp(request_range=pb.RangeRequest(key=key, keys_only=True))


class EtcdRW(RWStore):
    """A read-write lock in an etcd cluster (see the module)."""

    renew_chunk = None  # one keep-alive and one key listing per session, whatever the count

    def __init__(self, driver: EtcdDriver, name: str) -> None:
        super().__init__(name)
        self.client = driver.client
        self.leased = driver.leased
        self.display = driver.display
        base = rwlock_prefix(driver.prefix, name)
        self.writer, self.epoch = base + b"w", base + b"e"
        self.readers, self.intents = base + b"r/", base + b"i/"
        self._lease_name = LEASE_PREFIX + name

    def _key(self, mode: str, owner: str) -> bytes:
        return self.readers + owner.encode() if mode == READ else self.writer

    async def grant(self, mode: str, owner: str, ttl: float, *, intend: bool) -> RWAnswer:
        value = owner.encode()
        intent = self.intents + value
        for _ in range(2):
            session = await self.leased.session(ttl)
            key = self._key(mode, owner)
            put = pb.RequestOp(
                request_put=pb.PutRequest(key=key, value=value, lease=session.lease_id)
            )
            if mode == READ:
                request = pb.TxnRequest(
                    compare=[created_at(self.writer, 0), _empty(self.intents)],
                    success=[put, pb.RequestOp(request_range=pb.RangeRequest(key=self.epoch))],
                    failure=[_get(self.writer)],
                )
            else:
                failure = [_get(self.writer)]
                if intend:
                    failure.append(
                        pb.RequestOp(
                            request_put=pb.PutRequest(
                                key=intent, value=value, lease=session.lease_id
                            )
                        )
                    )
                request = pb.TxnRequest(
                    compare=[created_at(self.writer, 0), _empty(self.readers)],
                    success=[
                        put,
                        pb.RequestOp(request_put=pb.PutRequest(key=self.epoch)),
                        pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=intent)),
                    ],
                    failure=failure,
                )
            reply: Any = await self.leased.txn(session, request)
            if reply is None:
                continue  # the session's lease expired: again on a new one
            rev = reply.header.revision
            now = self.leased.now()
            if reply.succeeded:
                if mode == READ:
                    kvs = reply.responses[1].response_range.kvs
                    token = kvs[0].mod_revision if kvs else 0
                else:
                    token = rev
                    self.leased.drop(intent)
                entry = Leased(
                    key, value, owner, rev, token, session, ttl, now + ttl, self._lease_name
                )
                self.leased.add(entry)
                return int(token)
            writer_holds = bool(reply.responses[0].response_range.kvs)
            if mode == READ:
                return Held(WRITER_HOLDS if writer_holds else WRITER_WAITS)
            if intend:  # put again by this txn: live for ttl more unless refreshed
                self.leased.add(
                    Leased(intent, value, owner, None, 0, session, ttl, now + ttl, None)
                )
            return Held(WRITER_HOLDS if writer_holds else READERS_HOLD)
        return Held("the etcd session's lease keeps expiring")

    async def extend(self, mode: str, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        refs = [Renewal(self._key(mode, r.owner), r.owner, r.token, r.ttl) for r in leases]
        return await self.leased.renew(refs)

    async def release_hold(self, mode: str, owner: str, token: int | None) -> bool:
        key = self._key(mode, owner)
        entry = self.leased.entries.get(key)
        rev: int | None = None
        if entry is not None and entry.owner == owner:
            if token is not None and token != entry.token:
                return False
            rev = entry.rev
        elif token is not None and mode != READ:
            rev = token  # a writer's token is its key's create revision
        return await self.leased.delete(key, rev, owner)

    async def withdraw(self, owner: str) -> None:
        await self.leased.delete(self.intents + owner.encode(), None, owner)

    async def holders(self) -> list[Holder]:
        def get(key: bytes, prefix: bool = False) -> Any:
            end = prefix_end(key) if prefix else b""
            return pb.RequestOp(request_range=pb.RangeRequest(key=key, range_end=end))

        ops = [get(self.epoch), get(self.writer), get(self.readers, True), get(self.intents, True)]
        reply: Any = await self.client.txn(pb.TxnRequest(success=ops))  # one revision
        epoch_kv, writer_kv, reader_kvs, intent_kvs = (
            list(r.response_range.kvs) for r in reply.responses
        )
        left = await lease_left(self.client, writer_kv + reader_kvs + intent_kvs)

        def live(kvs: list[Any], base: bytes) -> list[tuple[str, float | None]]:
            found = []
            for kv in kvs:
                owner = bytes(kv.value)
                alive, remaining = live_left(kv, left)
                # (a key of another rwlock whose name extends this one's is not ours)
                if alive and (not base or kv.key == base + owner):
                    found.append((owner.decode("utf-8", "replace"), remaining))
            return found

        writer = live(writer_kv, b"")
        epoch = epoch_kv[0].mod_revision if epoch_kv else 0
        readers, intents = live(reader_kvs, self.readers), live(intent_kvs, self.intents)
        return rw_holders(self.name, epoch, writer[0] if writer else None, readers, intents)
