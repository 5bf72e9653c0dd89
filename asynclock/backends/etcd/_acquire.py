"""The etcd driver's acquire path: claim the name's slot, create our key, see who is first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from ..._core.clock import Clock
from ..._core.driver import Busy
from ..._core.exceptions import BackendUnavailable
from ..._core.turns import LINE_POLL, Turns
from . import _proto as pb
from ._deletions import Deletions
from ._kv import by_creation, created_at, delete_key
from ._session import Predecessor, Session, Sessions, _Slot
from .client import EtcdClient, EtcdError, prefix_end

#: A waiter's fallback poll: the predecessor watch is the real signal, this only bounds
#: the damage of a notification that never comes.
WAIT_POLL = 1.0
#: A non-blocking attempt behind another task of this process: when to try again.
LOCAL_POLL = 1.0


class Acquiring:
    """The acquire half of :class:`~asynclock.backends.etcd.EtcdDriver` (a mixin over its
    state)."""

    client: EtcdClient
    display: str
    clock: Clock
    sessions: Sessions
    slots: dict[str, _Slot]
    _queues: Turns
    _orphans: dict[bytes, tuple[int | None, bytes]]
    _granted_ttls: dict[str, int]
    deletions: Deletions

    if TYPE_CHECKING:

        def lock_prefix(self, name: str) -> bytes: ...

        def _unwatch_slot(self, slot: _Slot) -> None: ...

        async def _drop(self, slot: _Slot) -> bool: ...

        def _wake(self, name: str, owner: str | None = None, /) -> None: ...

    def _wake_turn(self, name: str) -> None:
        """``name``'s slot is free: the head of its local line may take it (only it is
        woken), or any waiter of ``name`` if it has no line."""
        head = self._queues.head(name)
        if head is not None:
            self._wake(name, head)
        else:
            self._wake(name)

    async def abandon(self, name: str, owner: str) -> None:
        head = self._queues.leave(name, owner)
        if head is not None and name not in self.slots:
            self._wake(name, head)  # the head left with the slot free: the next one's turn
        slot = self.slots.get(name)
        if slot is not None and slot.owner == owner and not slot.held:
            await self._drop(slot)  # frees the slot: wakes the head of the line

    def _key(self, name: str, session: Session) -> bytes:
        return self.lock_prefix(name) + f"{session.lease_id:x}".encode()

    def _claim(self, name: str, owner: str, ttl: float, queue: bool) -> _Slot | Busy:
        slot = self.slots.get(name)
        if slot is not None:
            if slot.owner == owner:
                return slot
            if not queue:
                return Busy(retry_after=None)
            # Behind the slot's owner: woken when the slot is freed (the head of the line
            # only: ``_free``), so this poll is only a fallback.
            self._queues.join(name, owner)
            return Busy(retry_after=LINE_POLL)
        turns = self._queues
        if turns.behind(name, owner):
            if queue:
                turns.join(name, owner)
                return Busy(retry_after=LINE_POLL)
            return Busy(retry_after=LOCAL_POLL)
        if turns:
            turns.leave(name, owner)  # its turn, taken: the next one waits for the slot
        slot = self.slots[name] = _Slot(name, owner, ttl)
        return slot

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        # ``scope`` needs nothing here: a token is a create revision, which rises across
        # the whole cluster, so it is above every token ever handed out, in any scope (G2).
        claimed = self._claim(name, owner, ttl, queue)
        if isinstance(claimed, Busy):
            return claimed
        slot = claimed
        for _ in range(3):
            if slot.session is None or slot.session.dead:
                session = await self.sessions.live(ttl)
                if self.slots.get(name) is not slot:
                    return Busy(retry_after=LOCAL_POLL)  # freed while we waited
                if slot.session is not session:
                    if slot.session is not None:
                        slot.session.users -= 1
                    slot.session, slot.rev = session, None
                    slot.key = self._key(name, session)
                    session.users += 1
                    session.idle_since = None
            session = slot.session
            assert session is not None
            result = await self._fresh_attempt(name, slot, session, ttl)
            if result is None:
                continue  # our key vanished or was a stale one: queue again
            if isinstance(result, int):
                slot.held = True
                slot.expires_at = self.clock.now() + ttl
                self._unwatch_slot(slot)
                if not self.deletions.covers(slot.seen_at):
                    session.recheck = True  # a deletion since may have gone unseen
                self._granted_ttls[owner] = session.granted
                return result
            if not queue:
                await self._drop(slot)
                return await self._holder_left(slot.holder_lease)
            return result  # its cursor says what to watch: see watch()
        raise BackendUnavailable(
            f"{self.display}: could not queue for {name!r}: our key kept vanishing"
        )

    async def _fresh_attempt(
        self, name: str, slot: _Slot, session: Session, ttl: float
    ) -> int | Busy | None:
        """G3: the attempt, plus a keep-alive sent alongside it when the session's last one
        is too old for a lock of ``ttl`` (both are sent after the core read its t_send, so
        the server keeps the key at least ``granted >= ttl`` past it)."""
        if self.sessions.fits(session, ttl):
            return await self._attempt(name, slot, session)
        failed: list[Exception] = []
        after = self.clock.now()  # (after the core's t_send)

        async def refresh() -> None:
            try:
                await self.sessions.keep_alive([session], after=after)
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(refresh)
            try:
                result = await self._attempt(name, slot, session)
            except Exception as exc:
                # Raised below, as it is: out of the group's body, anyio would wrap it in an
                # ExceptionGroup('unhandled errors in a TaskGroup') (the keep-alive runs on).
                failed.insert(0, exc)
                tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        if session.dead:
            raise BackendUnavailable(
                f"{self.display}: lease {session.lease_id:x} expired at the server"
            )
        return result

    async def _attempt(self, name: str, slot: _Slot, session: Session) -> int | Busy | None:
        """One txn: create our key (or look at it again) and see who holds the name.

        Returns our create revision if we hold it, Busy (its cursor the predecessor),
        or None if our key is gone or was a stale one of ours (deleted; try again).
        """
        prefix = self.lock_prefix(name)
        end = prefix_end(prefix)
        key = slot.key
        first = by_creation(prefix, end, pb.SORT_ASCEND, limit=1)
        if slot.rev is None:
            # Create our key; the last two keys by creation are ours and our predecessor.
            newest = by_creation(prefix, end, pb.SORT_DESCEND, limit=2)
            put = pb.RequestOp(
                request_put=pb.PutRequest(
                    key=key, value=slot.owner.encode(), lease=session.lease_id
                )
            )
            get = pb.RequestOp(request_range=pb.RangeRequest(key=key, keys_only=True))
            request = pb.TxnRequest(
                compare=[created_at(key, 0)], success=[put, first, newest], failure=[get]
            )
            try:
                reply = await self.client.txn(request)
            except EtcdError as exc:
                if exc.code == "NOT_FOUND":  # "requested lease not found"
                    self.sessions.lost(session, f"etcd lease {session.lease_id:x} expired")
                    return None
                raise
            if not reply.succeeded:
                # A key of ours left from an earlier hold (its release never confirmed):
                # its revision is an old token, never reuse it (G2). Delete, start over.
                kvs = reply.responses[0].response_range.kvs
                stale = kvs[0].create_revision if kvs else None
                await delete_key(self.client, key, stale, None)
                self._orphans.pop(key, None)
                return None
            slot.rev = slot.seen_at = reply.header.revision
            holder = reply.responses[1].response_range.kvs
            newest_kvs = reply.responses[2].response_range.kvs
            if not holder or holder[0].create_revision == slot.rev:
                return slot.rev
            pred = newest_kvs[1].key if len(newest_kvs) > 1 else holder[0].key
            slot.holder_lease = holder[0].lease
            return self._behind(slot, pred, reply.header.revision)
        before = by_creation(prefix, end, pb.SORT_DESCEND, limit=1, below=slot.rev)
        request = pb.TxnRequest(compare=[created_at(key, slot.rev)], success=[first, before])
        reply = await self.client.txn(request)
        if not reply.succeeded:
            slot.rev = None
            self._unwatch_slot(slot)
            return None
        slot.seen_at = reply.header.revision
        holder = reply.responses[0].response_range.kvs
        earlier = reply.responses[1].response_range.kvs
        if not earlier or (holder and holder[0].create_revision == slot.rev):
            return slot.rev
        slot.holder_lease = holder[0].lease if holder else 0
        return self._behind(slot, earlier[0].key, reply.header.revision)

    @staticmethod
    def _behind(slot: _Slot, pred: bytes, revision: int) -> Busy:
        """Busy behind ``pred``, seen at ``revision``: the core hands the cursor to
        :meth:`watch` (again whenever it changes)."""
        return Busy(retry_after=WAIT_POLL, cursor=Predecessor(slot.owner, pred, revision))

    async def _holder_left(self, lease_id: int) -> Busy:
        """For LockHeld: how long the holder's etcd lease has left (it may be etcdctl's
        10 s session by default), from the server; unknown if the lookup fails."""
        if not lease_id:
            return Busy(retry_after=None)
        try:
            reply = await self.client.time_to_live(lease_id, keys=False)
        except EtcdError:
            return Busy(retry_after=None)
        # Whole seconds, rounded down: the lease lives at least this long from now (and
        # etcd's expiry sweep adds up to half a second), never less.
        return Busy(retry_after=float(max(reply.TTL, 0)))
