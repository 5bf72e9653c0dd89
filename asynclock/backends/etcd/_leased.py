"""Keys of semaphore permits and read-write holds on an etcd driver's shared sessions.

A permit or a hold is one key put on the session of its ttl (the driver's
:class:`~._session.Sessions`, shared with its locks), so a crashed process's keys vanish
when that session's etcd lease expires. While the process lives the session is kept
alive for its other users, so this registry expires locally what the core stops renewing
(a lease lost here, a waiting writer's intent it stopped refreshing): its key is deleted
once its ttl has passed since the last confirmed renewal — when a lease of its own would
have expired at the server — exactly as the driver does for its locks.

Renewal of many keys is one keep-alive and one key listing per session per call, as for
locks: a key is renewed if it is still attached to its live session.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from ..._core.driver import ExtendResult, Refused
from ..._core.exceptions import BackendUnavailable
from . import _proto as pb
from ._kv import created_at, delete_key
from .client import EtcdError

if TYPE_CHECKING:
    from ._session import Session, Sessions
    from .client import EtcdClient


def name_segment(name: str) -> str:
    """``name`` as one key segment: ``%`` and ``/`` escaped, so the keys of ``x/r`` are
    never inside the range of ``x``'s (a read-write lock ``x`` lists ``.../x/r/``)."""
    return name.replace("%", "%25").replace("/", "%2F")


@dataclass(eq=False)
class Leased:
    """One key of ours on a session: a permit, a read or write hold, or a writer's intent."""

    key: bytes
    value: bytes
    owner: str
    #: The key's create revision (None: not known, an intent re-put by a failed txn).
    rev: int | None
    #: What the core holds as the lease's token (a permit's or a writer's: ``rev``; a
    #: reader's: the epoch it was granted with).
    token: int
    session: Session
    ttl: float
    expires_at: float
    #: The core's lease name, to tell a loss out of band (None: an intent, no lease).
    lease_name: str | None


class Renewal(NamedTuple):
    """One key to renew: which, whose, with which token, for how long."""

    key: bytes
    owner: str
    token: int
    ttl: float


class LeasedKeys:
    """The driver's registry of permit and hold keys (see the module)."""

    def __init__(
        self,
        client: EtcdClient,
        sessions: Sessions,
        *,
        now: Callable[[], float],
        poke: Callable[[], None],
        notify_lost: Callable[[str, str, str], None],
        orphans: dict[bytes, tuple[int | None, bytes]],
    ) -> None:
        self.client = client
        self.sessions = sessions
        self._now = now
        self._poke = poke
        self._notify_lost = notify_lost
        self._orphans = orphans
        self.entries: dict[bytes, Leased] = {}

    def now(self) -> float:
        return self._now()

    async def session(self, ttl: float) -> Session:
        """The live session for a key of ``ttl`` taken now (G3: a keep-alive first when
        its last one is too old for ``ttl``, sent after the core read its t_send)."""
        after = self._now()  # (after the core's t_send)
        for _ in range(2):
            session = await self.sessions.live(ttl)
            if not self.sessions.fits(session, ttl):
                await self.sessions.keep_alive([session], after=after)
            if not session.dead:
                return session
        raise BackendUnavailable(f"etcd lease for ttl {ttl} keeps expiring at the server")

    async def txn(self, session: Session, request: object) -> Any:
        """Run a txn that puts keys on ``session``; None if etcd says the session's lease
        is gone (the session is lost: try again on a new one)."""
        try:
            return await self.client.txn(request)
        except EtcdError as exc:
            if exc.code == "NOT_FOUND":  # "requested lease not found"
                self.sessions.lost(session, f"etcd lease {session.lease_id:x} expired")
                return None
            raise

    def add(self, entry: Leased) -> None:
        old = self.entries.get(entry.key)
        if old is not None:
            self.drop(old.key)
        self.entries[entry.key] = entry
        entry.session.users += 1
        entry.session.idle_since = None
        self._poke()  # its expiry needs scheduling

    def drop(self, key: bytes) -> Leased | None:
        entry = self.entries.pop(key, None)
        if entry is not None and not entry.session.dead:
            entry.session.users -= 1
            if entry.session.users <= 0:
                entry.session.idle_since = self._now()
        return entry

    async def delete(self, key: bytes, rev: int | None, owner: str) -> bool:
        """Delete our key (guarded by its create revision, else by its owner), forgetting
        it here first; a delete that fails is retried by the driver's housekeeping."""
        entry = self.entries.get(key)
        if entry is not None and entry.owner == owner:
            self.drop(key)
        else:
            entry = None
        value = owner.encode() if entry is None else entry.value
        try:
            return await delete_key(self.client, key, rev, value)
        except BaseException:
            if entry is not None and not entry.session.dead:
                self._orphans[key] = (rev, value)
            raise

    async def renew(self, refs: Sequence[Renewal]) -> list[ExtendResult]:
        """Renew these keys: one keep-alive and one key listing per session."""
        t_send = self._now()
        results: list[ExtendResult | None] = []
        sessions: dict[int, Session] = {}
        for ref in refs:
            entry = self.entries.get(ref.key)
            if entry is None or entry.owner != ref.owner or entry.token != ref.token:
                results.append(Refused("not held by this owner (expired or released)"))
            elif ref.ttl != entry.ttl:
                try:
                    results.append(await self._move(entry, ref.ttl, t_send))
                except Exception as exc:
                    results.append(exc)
            else:
                sessions[entry.session.lease_id] = entry.session
                results.append(None)
        attached: dict[int, set[bytes]] = {}

        async def keys_of(session: Session) -> None:
            reply = await self.client.time_to_live(session.lease_id, keys=True)
            attached[session.lease_id] = set(reply.keys) if reply.TTL >= 0 else set()

        if sessions:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    partial(self.sessions.keep_alive, after=t_send), list(sessions.values())
                )
                for session in sessions.values():
                    tg.start_soon(keys_of, session)
        out: list[ExtendResult] = []
        for ref, result in zip(refs, results, strict=True):
            if result is not None:
                out.append(result)
                continue
            entry = self.entries.get(ref.key)
            if entry is None or entry.owner != ref.owner:
                out.append(Refused("lost while renewing"))
            elif entry.session.dead:
                out.append(Refused(f"etcd lease {entry.session.lease_id:x} expired"))
            elif ref.key not in attached.get(entry.session.lease_id, set()):
                self.drop(ref.key)
                out.append(Refused("the key was deleted at the server"))
            else:
                entry.expires_at = max(entry.expires_at, t_send + ref.ttl)
                out.append(True)
        return out

    async def _move(self, entry: Leased, ttl: float, t_send: float) -> ExtendResult:
        """``lease.extend(ttl)``: put the key on the new ttl's session (a put keeps the
        create revision, so the token is unchanged)."""
        session = await self.session(ttl)
        put = pb.PutRequest(key=entry.key, value=entry.value, lease=session.lease_id)
        assert entry.rev is not None
        reply = await self.client.txn(
            pb.TxnRequest(
                compare=[created_at(entry.key, entry.rev)],
                success=[pb.RequestOp(request_put=put)],
            )
        )
        if not reply.succeeded:
            self.drop(entry.key)
            return Refused("the key was deleted at the server")
        if self.entries.get(entry.key) is not entry:
            return Refused("lost while renewing")
        self.drop(entry.key)
        entry.session, entry.ttl, entry.expires_at = session, ttl, t_send + ttl
        self.add(entry)
        return True

    def expire(self, now: float) -> float:
        """Forget every key whose ttl has passed since its last confirmed renewal (its
        delete is left to the driver's orphan retries); returns when the next one is due."""
        due = math.inf
        for key, entry in list(self.entries.items()):
            if now >= entry.expires_at:
                self.drop(key)
                if not entry.session.dead:
                    self._orphans[key] = (entry.rev, entry.value)
            else:
                due = min(due, entry.expires_at)
        return due

    def session_lost(self, session: Session, why: str) -> None:
        """``session`` is gone at the server: so is every key on it (G4)."""
        for key, entry in list(self.entries.items()):
            if entry.session is session:
                del self.entries[key]
                if entry.lease_name is not None:
                    self._notify_lost(entry.lease_name, entry.owner, why)
