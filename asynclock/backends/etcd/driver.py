"""The etcd driver: etcd's ``concurrency.Mutex`` layout over shared session leases.

* **Sessions.** One etcd lease per distinct ttl in use (granted on first use, revoked once
  nothing has used it for a while), all kept alive on the client's one keep-alive stream.
  etcd grants whole seconds and at least its minimum (about 1.5 election timeouts); we ask
  for the next whole second above ``ttl`` so a key outlives the local deadline the core
  computes from the ttl asked for (G3): a lock is taken, and renewed, only with a
  keep-alive of its session acknowledged recently enough (sent alongside the acquire when
  the last one is too old). A lease the server reports gone (TTL <= 0) loses every holder
  on it at once (like ``Session.Done()``). ``lease.extend(ttl)`` moves the key to the new
  ttl's session (a put keeps its create revision: same token).
* **Mutex.** A lock's key is ``<prefix><name>/<lease id in hex>``, created in a txn with
  ``create_revision == 0``; the holder is the key with the lowest create revision under
  ``<prefix><name>/``; a waiter watches only its predecessor (FIFO, no herd). The token is
  the holder key's create revision: cluster-wide and monotonic (G2). ``etcdctl lock NAME``
  and Go's ``concurrency.Mutex`` use the same layout, so they exclude each other with us.
* **One participant per name per process.** Two tasks here on one name and ttl would write
  the same key (etcd's Mutex calls that a re-lock), so each name has one *slot*: the task
  that owns it is the process's participant in etcd; other tasks queue locally, first come
  first served, and take the slot when it is freed.
* **Driver-side expiry.** A held slot the core stops renewing (a lease lost locally) is
  deleted by the driver once its ttl has passed since the last confirmed renewal, exactly
  when the server would have expired a per-lock lease — the shared session keeps living
  for the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any

import anyio

from ..._core.driver import Driver, ExtendResult, LeaseRef, Record, Refused
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from ..._core.turns import Turns
from ..._core.validation import RESERVED_PREFIX
from .._common.asyncio_only import require_asyncio
from . import _proto as pb
from ._acquire import Acquiring
from ._deletions import Deletions
from ._kv import created_at, delete_key, first_key
from ._leased import LeasedKeys
from ._release import Releasing
from ._rw import EtcdRW
from ._sem import EtcdPermits, HoldNames
from ._session import Session, Sessions, _Slot
from ._watch import Watching
from .client import EtcdClient, prefix_end

_HEX = frozenset(b"0123456789abcdef")
#: How long a renewal waits for the watch stream's progress, as a fraction of the shortest
#: ttl renewed, before it lists the sessions' keys instead.
CATCH_UP = 0.1
logger = logging.getLogger("asynclock.etcd")


class EtcdDriver(Acquiring, Releasing, Watching, HoldNames, Driver):
    """Locks in an etcd cluster. See the module docstring and docs/backends/etcd.md."""

    remote = True  # every acquire and release is a server round trip
    #: One call renews every lease: a keep-alive per session, then a listing of each
    #: session's keys (few names in use) or one progress request on the watch stream
    #: (many: see ``_deletions.py``), whatever the number of leases.
    renew_chunk = None
    #: A freed slot wakes the head of the name's local line, a predecessor's deletion the
    #: slot's owner (``_wake_turn``, ``_watch_key``): one waiter, never all of them.
    wakes_waiters = True

    def __init__(self, client: EtcdClient, *, prefix: str = "", display: str) -> None:
        super().__init__()
        self.client = client
        self.prefix = prefix
        self.display = display
        self._init_releasing()
        self.sessions = Sessions(
            client,
            display=display,
            now=lambda: self.clock.now(),  # the backend binds its clock after construction
            on_granted=lambda: self._poke.set(),  # its keep-alives need scheduling
            on_lost=self._session_lost,
        )
        self.slots: dict[str, _Slot] = {}
        #: Tasks of this process waiting for a name's slot (one key per name per process).
        self._queues = Turns()
        #: Keys of ours whose delete failed: key -> (create revision, owner), retried.
        self._orphans: dict[bytes, tuple[int | None, bytes]] = {}
        self._poke = anyio.Event()
        self._granted_ttls: dict[str, int] = {}
        self._prefix = prefix.encode("utf-8", "surrogatepass")
        self.deletions = Deletions(client, self._prefix, self._key_deleted)
        client.on_watch_reset = self._watches_reset
        #: Semaphore permits and read-write holds (their keys share the sessions).
        self.leased = LeasedKeys(
            client,
            self.sessions,
            now=lambda: self.clock.now(),
            poke=lambda: self._poke.set(),
            notify_lost=lambda name, owner, why: self._notify_lost(name, owner, why),
            orphans=self._orphans,
        )

    # -- keys ------------------------------------------------------------------------------

    def lock_prefix(self, name: str) -> bytes:
        return f"{self.prefix}{name}/".encode("utf-8", "surrogatepass")

    def record_key(self, name: str) -> bytes:
        """The idempotency record of ``name``. ``"\\x00asynclock.record"`` is a reserved
        lock name (never created), so the key is under no lock's prefix."""
        return f"{self.prefix}\x00asynclock.record/{name}".encode("utf-8", "surrogatepass")

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        require_asyncio(self.display, "grpc.aio")
        await self.client.open()

    async def aclose(self) -> None:
        self._deletes.close(f"{self.display} was closed")
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.client.timeout):
                await self.sessions.revoke_all()
            try:
                await self.client.aclose()
            except Exception as exc:  # pragma: no cover - must not raise
                logger.debug("closing the etcd client failed: %r", exc)

    async def background(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.client.run_keepalive_stream)
            tg.start_soon(self.client.run_watch_stream)
            tg.start_soon(self._housekeeping)

    # -- sessions --------------------------------------------------------------------------

    def _session_lost(self, session: Session, why: str) -> None:
        """``session`` is gone at the server: its holders lose their locks at once (G4),
        its waiters queue again."""
        self.leased.session_lost(session, why)
        for name, slot in list(self.slots.items()):
            if slot.session is not session:
                continue
            if slot.held:
                self._free(name, slot)
                self._notify_lost(name, slot.owner, why)
            else:  # a waiter: its key is gone; the next attempt queues again
                self._unwatch_slot(slot)
                slot.session, slot.key, slot.rev = None, b"", None
                self._wake(name, slot.owner)

    def _key_deleted(self, key: bytes, revision: int) -> None:
        """The deletions watch saw ``key`` deleted at ``revision``: if it is a key we hold
        (and was seen before that), the next renewal refuses it; ask for that round now."""
        name, slash, _ = key[len(self._prefix) :].rpartition(b"/")
        slot = self.slots.get(name.decode("utf-8", "surrogatepass")) if slash else None
        if slot is None or not slot.held or slot.key != key or revision <= slot.seen_at:
            return
        slot.gone = True
        if not slot.releasing:
            self._renew_now()

    def _watches_reset(self) -> None:
        self._waits_reset()
        self.deletions.reset()

    # -- renew, release, validate ----------------------------------------------------------

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        t_send = self.clock.now()
        results: list[ExtendResult | None] = []
        sessions: dict[int, Session] = {}
        for ref in leases:
            slot = self.slots.get(ref.name)
            if slot is None or slot.owner != ref.owner or not slot.held or slot.rev != ref.token:
                results.append(Refused("not held by this owner"))
                continue
            assert slot.session is not None
            if ref.ttl != slot.ttl:  # lease.extend(ttl): the key moves to that ttl's session
                try:
                    results.append(await self._move(slot, ref, t_send))
                except Exception as exc:
                    results.append(exc)
                continue
            sessions[slot.session.lease_id] = slot.session
            results.append(None)
        if not sessions:
            return [r for r in results if r is not None]
        attached = await self._renew_sessions(list(sessions.values()), t_send)
        out: list[ExtendResult] = []
        for ref, result in zip(leases, results, strict=True):
            if result is not None:
                out.append(result)
                continue
            slot = self.slots.get(ref.name)
            if slot is None or slot.owner != ref.owner or not slot.held:
                out.append(Refused("lost while renewing"))
                continue
            held_on = slot.session
            assert held_on is not None
            keys = attached.get(held_on.lease_id)
            if held_on.dead:
                out.append(Refused(f"etcd lease {held_on.lease_id:x} expired"))
            elif slot.gone or (keys is not None and slot.key not in keys):
                out.append(Refused("lock key deleted at the server"))
            else:
                slot.expires_at = max(slot.expires_at, t_send + ref.ttl)
                out.append(True)
        return out

    async def _renew_sessions(
        self, sessions: list[Session], t_send: float
    ) -> dict[int, set[bytes]]:
        """A keep-alive for each session; then, with the deletions watch live, one progress
        request on the watch stream: once it answers at a revision the keep-alives' acks
        had reached, every deletion of a held key before this round was sent has been seen
        (see ``_deletions.py``). Returns the keys attached to each session that had to be
        listed instead: no live watch (few names held), the progress did not come in time,
        or a deletion may have gone unseen (``Session.recheck``)."""
        deletions = self.deletions
        if not deletions.wanted(len(self.slots)):
            # No watch and none wanted (few names): keep-alives and listings in one trip.
            alive = partial(self.sessions.keep_alive, after=t_send)
            return await self._list_sessions(sessions, alive=alive)
        confirmed = deletions.confirmed
        await self.sessions.keep_alive(sessions, after=t_send)
        if self.deletions.went_live(confirmed, self.client.acked_revision):
            for session in self.sessions.values():
                session.recheck = True  # its keys were seen before the watch's start
        self.deletions.fit(len(self.slots))
        live = [s for s in sessions if not s.dead]
        caught_up = False
        if self.deletions.since and any(not s.recheck for s in live):
            within = min(self.client.timeout, min(s.ttl for s in live) * CATCH_UP)
            caught_up = await self.client.watches_caught_up(self.client.acked_revision, within)
        return await self._list_sessions([s for s in live if s.recheck or not caught_up], None)

    async def _list_sessions(
        self,
        sessions: list[Session],
        alive: Callable[[list[Session]], Coroutine[Any, Any, None]] | None,
    ) -> dict[int, set[bytes]]:
        """The keys attached to each of ``sessions``, listed at once (``alive``: beside the
        keep-alives)."""
        attached: dict[int, set[bytes]] = {}

        async def keys_of(session: Session) -> None:
            session.recheck = False  # a gap found from now on asks again
            try:
                reply = await self.client.time_to_live(session.lease_id, keys=True)
            except BaseException:
                session.recheck = True
                raise
            # TTL is whole seconds left, rounded down (0 is alive); -1: the lease is gone.
            attached[session.lease_id] = set(reply.keys) if reply.TTL >= 0 else set()

        async with anyio.create_task_group() as tg:
            if alive is not None:
                tg.start_soon(alive, sessions)
            for session in sessions:
                tg.start_soon(keys_of, session)
        return attached

    async def _move(self, slot: _Slot, ref: LeaseRef, t_send: float) -> ExtendResult:
        """Attach a held key to the session of a new ttl (``lease.extend(ttl)``): a put on
        the existing key keeps its create revision, so the token is unchanged (G7)."""
        session = await self.sessions.live(ref.ttl)
        put = pb.RequestOp(
            request_put=pb.PutRequest(
                key=slot.key, value=slot.owner.encode(), lease=session.lease_id
            )
        )
        assert slot.rev is not None
        reply = await self.client.txn(
            pb.TxnRequest(compare=[created_at(slot.key, slot.rev)], success=[put])
        )
        if not reply.succeeded:
            return Refused("lock key deleted at the server")
        if not self.sessions.fits(session, ref.ttl):
            await self.sessions.keep_alive([session], after=t_send)  # G3 for the new ttl
        if session.dead:
            return Refused(f"etcd lease {session.lease_id:x} expired")
        if self.slots.get(slot.name) is not slot or not slot.held:
            return Refused("lost while renewing")
        old = slot.session
        if old is not None and old is not session:
            old.users -= 1
            if old.users <= 0:
                old.idle_since = self.clock.now()
        session.users += 1
        session.idle_since = None
        slot.session, slot.ttl = session, ref.ttl
        slot.expires_at = t_send + ref.ttl
        self._granted_ttls[slot.owner] = session.granted
        return True

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        return EtcdPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        return EtcdRW(self, name)

    async def validate(self, name: str, token: int) -> bool:
        kv = await first_key(self.client, self.lock_prefix(name), keys_only=True)
        return kv is not None and kv.create_revision == token

    async def names(self) -> list[str]:
        # Every key <prefix><name>/<lease id in hex>: ours, etcdctl's and Go's Mutex's.
        start = self.prefix.encode("utf-8", "surrogatepass")
        reply = await self.client.range(
            pb.RangeRequest(key=start or b"\0", range_end=prefix_end(start), keys_only=True)
        )
        found: dict[str, None] = {}
        for kv in reply.kvs:
            name, slash, lease = kv.key[len(start) :].rpartition(b"/")
            if slash and lease and all(c in _HEX for c in lease):
                found[name.decode("utf-8", "surrogatepass")] = None
        for name in [n for n in found if n.startswith(RESERVED_PREFIX)]:
            del found[name]  # records, permits, read-write holds: not locks
        return list(found)

    async def holder(self, name: str) -> Holder | None:
        kv = await first_key(self.client, self.lock_prefix(name))
        if kv is None:
            return None
        remaining: float | None = None
        if kv.lease:
            reply = await self.client.time_to_live(kv.lease, keys=False)
            if reply.TTL < 0:
                return None  # its lease just expired: the key is being deleted
            remaining = float(reply.TTL)  # whole seconds, rounded down
        # Our keys carry the owner; etcdctl's and Go's Mutex keys are empty.
        owner = kv.value.decode("utf-8", "replace") or None
        return Holder(name, owner, kv.create_revision, remaining)

    async def break_lock(self, name: str) -> bool:
        kv = await first_key(self.client, self.lock_prefix(name))
        if kv is None:
            return False
        # G2: the next key anyone creates gets a larger revision; the broken holder's next
        # renewal finds its key gone (refused).
        broken = await delete_key(self.client, kv.key, kv.create_revision, None)
        slot = self.slots.get(name)
        if broken and slot is not None and slot.key == kv.key:
            self._free(name, slot)  # a holder here: the name is free for the next task now
        return broken

    # -- idempotency records: a key with an etcd lease of ``keep`` --------------------------

    async def record_get(self, name: str) -> Record | None:
        reply = await self.client.range(pb.RangeRequest(key=self.record_key(name)))
        if not reply.kvs:
            return None
        token, _, payload = bytes(reply.kvs[0].value).partition(b"\n")
        return Record(int(token), payload.decode())

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        # Our lock key: the slot's, or (the slot is gone here: lost locally) the holder's.
        slot = self.slots.get(name)
        if slot is not None and slot.owner == owner and slot.held and slot.rev == token:
            lock_key = slot.key
        else:
            kv = await first_key(self.client, self.lock_prefix(name), keys_only=True)
            if kv is None or kv.create_revision != token:
                return False
            lock_key = kv.key
        # G8: while our lock key exists with create revision = token, no key under the
        # prefix is older, so we hold the lock; the Txn checks that and writes in one step.
        # (etcd's leases are whole seconds; its longest lease is far above 30 days.)
        granted = await self.client.grant(math.ceil(keep))
        put = pb.PutRequest(
            key=self.record_key(name),
            value=b"%d\n" % token + payload.encode(),
            lease=granted.ID,
            prev_kv=True,
        )
        reply = await self.client.txn(
            pb.TxnRequest(
                compare=[created_at(lock_key, token)], success=[pb.RequestOp(request_put=put)]
            )
        )
        old = granted.ID
        if reply.succeeded:
            prev = reply.responses[0].response_put.prev_kv
            old = prev.lease if prev.lease and prev.lease != granted.ID else 0
        if old:
            await self._revoke_quietly(old)  # the replaced record's lease, or ours unused
        return bool(reply.succeeded)

    async def record_delete(self, name: str, token: int) -> bool:
        key = self.record_key(name)
        reply = await self.client.range(pb.RangeRequest(key=key))
        if not reply.kvs or not bytes(reply.kvs[0].value).startswith(b"%d\n" % token):
            return False
        kv = reply.kvs[0]
        same = pb.Compare(result=pb.CMP_EQUAL, target=pb.CMP_TARGET_MOD, key=key)
        same.mod_revision = kv.mod_revision
        delete = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))
        done = await self.client.txn(pb.TxnRequest(compare=[same], success=[delete]))
        if done.succeeded and kv.lease:
            await self._revoke_quietly(kv.lease)
        return bool(done.succeeded)

    async def _revoke_quietly(self, lease_id: int) -> None:
        """Revoke a record's lease nothing needs any more (it would expire by itself)."""
        try:
            await self.client.revoke(lease_id)
        except Exception as exc:
            logger.debug("revoking record lease %x failed: %r", lease_id, exc)

    def granted_ttl(self, owner: str) -> int | None:
        """Seconds etcd granted the session lease of the hold ``owner`` (None: unknown)."""
        return self._granted_ttls.get(owner)

    # -- helpers ---------------------------------------------------------------------------

    def _free(self, name: str, slot: _Slot) -> None:
        if self.slots.get(name) is not slot:
            return
        del self.slots[name]
        self._granted_ttls.pop(slot.owner, None)
        self._unwatch_slot(slot)
        session = slot.session
        if session is not None:
            session.users -= 1
            if session.users <= 0:
                session.idle_since = self.clock.now()
        self._wake_turn(name)

    async def _housekeeping(self) -> None:
        """Keep sessions alive, expire holds the core stopped renewing, retry orphan
        deletes, revoke sessions nobody used for a while."""
        while True:
            now = self.clock.now()
            due = min(now + 1.0, await self.sessions.renew_due(now))
            now = self.clock.now()
            for name, slot in list(self.slots.items()):
                if not slot.held or slot.releasing:
                    continue  # (a release in flight deletes the key itself)
                if now >= slot.expires_at:
                    # The core stopped renewing (lost locally): expire it like the server
                    # would a lease of its own.
                    if slot.session is not None and not slot.session.dead:
                        self._orphans[slot.key] = (slot.rev, slot.owner.encode())
                    self._free(name, slot)
                else:
                    due = min(due, slot.expires_at)
            due = min(due, self.leased.expire(now))
            for key, (rev, owner) in list(self._orphans.items()):
                try:
                    await delete_key(self.client, key, rev, owner)
                except Exception as exc:
                    logger.debug("delete of %r failed, will retry: %r", key, exc)
                    due = min(due, self.clock.now() + 0.2)
                else:
                    self._orphans.pop(key, None)
            due = min(due, await self.sessions.revoke_idle(now))
            self._poke = anyio.Event()
            with anyio.move_on_after(max(0.0, due - self.clock.now())):
                await self._poke.wait()
