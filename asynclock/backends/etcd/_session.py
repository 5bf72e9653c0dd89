"""An etcd driver's sessions (one etcd lease per ttl in use: granted, kept alive, revoked)
and its per-name slots."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from ..._core.exceptions import BackendUnavailable
from .client import EtcdError

if TYPE_CHECKING:
    from .client import EtcdClient

logger = logging.getLogger("asynclock.etcd")

#: Server and client clocks may run at slightly different rates.
SERVER_DRIFT = 0.01


def requested_ttl(ttl: float) -> int:
    """The whole seconds asked of etcd for locks of ``ttl`` (the server may grant more):
    the next whole second above ``ttl``, so a key outlives the local deadline, and etcd's
    remaining TTL (whole seconds, rounded down) never reads above ``ttl``."""
    return max(1, math.floor(ttl) + 1)


@dataclass(eq=False)
class Session:
    """One etcd lease shared by every lock of one ttl in this process."""

    ttl: float
    lease_id: int
    granted: int
    #: Our clock, read before the last acknowledged keep-alive (or the grant) was sent: the
    #: server's lease lives at least ``granted`` seconds past it.
    acked_at: float
    users: int = 0
    idle_since: float | None = None
    dead: bool = False
    #: List the keys attached to the lease at the next renewal (once): a deletion of one
    #: of them may have happened where the deletions watch did not see it.
    recheck: bool = False

    @property
    def headroom(self) -> float:
        """How much longer than a lock's ttl the lease lives after a keep-alive."""
        return self.granted * (1 - SERVER_DRIFT) - self.ttl

    @property
    def interval(self) -> float:
        """Keep-alive period: often enough that a new lock of ``ttl`` usually fits without
        a keep-alive of its own (see :meth:`Acquiring._fresh_attempt`)."""
        if self.headroom < 0.1:
            return self.granted / 3
        return max(0.05, min(self.granted / 3, self.headroom / 2))


class _Flight:
    """One keep-alive of one session: sent at ``sent_at`` (our clock), answered once
    ``done`` is set with ``ok`` (or ``error``); neither: abandoned unsent."""

    __slots__ = ("done", "error", "ok", "sent_at")

    def __init__(self) -> None:
        self.sent_at = math.inf
        self.done = anyio.Event()
        self.ok = False
        self.error: Exception | None = None


class Sessions(Mapping[float, Session]):
    """A driver's sessions by ttl: granted on first use (:meth:`live`), kept alive
    (:meth:`keep_alive`, :meth:`renew_due`), dropped when the server says the lease is gone
    (:meth:`lost`), revoked once nobody used them for a while (:meth:`revoke_idle`).

    ``now()`` reads the driver's clock (bound after construction); ``on_granted()`` runs
    when a session is new (its keep-alives need scheduling); ``on_lost(session, why)`` once
    a session is gone, so the locks on it can be lost (G4)."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        display: str,
        now: Callable[[], float],
        on_granted: Callable[[], None],
        on_lost: Callable[[Session, str], None],
    ) -> None:
        self._client = client
        self._display = display
        self._now = now
        self._on_granted = on_granted
        self._on_lost = on_lost
        self._by_ttl: dict[float, Session] = {}
        self._granting: dict[float, anyio.Event] = {}
        #: By lease id: the keep-alive in flight, and the one to send when it is answered.
        self._flying: dict[int, _Flight] = {}
        self._following: dict[int, _Flight] = {}

    def __getitem__(self, ttl: float) -> Session:
        return self._by_ttl[ttl]

    def __iter__(self) -> Iterator[float]:
        return iter(self._by_ttl)

    def __len__(self) -> int:
        return len(self._by_ttl)

    async def live(self, ttl: float) -> Session:
        """The live session of ``ttl``, granted now if there is none."""
        while True:
            session = self._by_ttl.get(ttl)
            if session is not None and not session.dead:
                return session
            granting = self._granting.get(ttl)
            if granting is not None:
                await granting.wait()
                continue
            granting = self._granting[ttl] = anyio.Event()
            try:
                # Shielded (the call has its deadline): a grant another task is waiting for
                # must not be abandoned half way because the first asker was cancelled.
                with anyio.CancelScope(shield=True):
                    t_send = self._now()
                    reply = await self._client.grant(requested_ttl(ttl))
                if reply.error or reply.TTL <= 0:
                    raise BackendUnavailable(f"{self._display}: lease grant refused: {reply.error}")
                session = Session(ttl, reply.ID, reply.TTL, t_send)
                self._by_ttl[ttl] = session
                self._on_granted()
                return session
            finally:
                del self._granting[ttl]
                granting.set()

    def lost(self, session: Session, why: str) -> None:
        """The server says the lease is gone: every lock on it is lost at once (G4)."""
        if session.dead:
            return
        session.dead = True
        if self._by_ttl.get(session.ttl) is session:
            del self._by_ttl[session.ttl]
        self._on_lost(session, why)

    def fits(self, session: Session, ttl: float) -> bool:
        """Does the session outlive a lock of ``ttl`` taken now, on its last keep-alive?"""
        return session.acked_at + session.granted * (1 - SERVER_DRIFT) >= self._now() + ttl

    async def keep_alive(self, sessions: Sequence[Session], *, after: float) -> None:
        """A keep-alive for each of ``sessions`` sent at ``after`` or later (our clock),
        acknowledged: what G3 needs of a key taken, or renewed, at ``after``.

        One keep-alive per session is in flight at a time: a caller joins the one in
        flight if it was sent at ``after`` or later, else the next one, sent as soon as
        the one in flight is answered. Acks come back in order on the one stream, so
        one keep-alive per caller (2,000 acquisitions at once on a loaded machine) queued
        each behind all the others: acks came seconds late, keep-alives timed out and
        healthy leases were lost (issue 45)."""
        if len(sessions) == 1:
            await self._keep_alive_one(sessions[0], after)
            return
        errors: list[Exception] = []

        async def one(session: Session) -> None:
            try:
                await self._keep_alive_one(session, after)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(one, session)
        if errors:
            raise errors[0]

    async def _keep_alive_one(self, session: Session, after: float) -> None:
        lease_id = session.lease_id
        while not session.dead:
            flying = self._flying.get(lease_id)
            following = self._following.get(lease_id)
            if flying is not None and flying.sent_at >= after:
                flight = flying
            elif following is not None:
                flight = following
            elif flying is None:
                await self._send(session, _Flight())
                return
            else:  # the one in flight was sent too early: the next one, sent by us
                flight = self._following[lease_id] = _Flight()
                try:
                    await flying.done.wait()
                except BaseException:
                    if self._following.get(lease_id) is flight:
                        del self._following[lease_id]
                    flight.done.set()  # abandoned unsent: its joiners go again
                    raise
                if self._following.get(lease_id) is flight:
                    del self._following[lease_id]
                await self._send(session, flight)
                return
            await flight.done.wait()
            if flight.ok:
                return
            if flight.error is not None:
                error = flight.error
                if isinstance(error, EtcdError):  # (a fresh one per joiner: own traceback)
                    raise EtcdError(error.message, error.code) from error
                raise error
            # Abandoned unsent (its sender was cancelled): go again.

    async def _send(self, session: Session, flight: _Flight) -> None:
        lease_id = session.lease_id
        flight.sent_at = self._now()
        self._flying[lease_id] = flight
        try:
            ttls = await self._client.keep_alive([lease_id])
            ttl = ttls.get(lease_id)
            if ttl is not None and ttl <= 0:
                self.lost(session, f"etcd lease {lease_id:x} expired")
            elif ttl is not None and flight.sent_at > session.acked_at:
                session.acked_at = flight.sent_at
            flight.ok = True
        except Exception as exc:
            flight.error = exc
            raise
        finally:
            if self._flying.get(lease_id) is flight:
                del self._flying[lease_id]
            flight.done.set()

    async def renew_due(self, now: float) -> float:
        """A keep-alive for each session in use whose last one is ``interval`` old at
        ``now``; returns when the next one is due."""
        due = math.inf
        alive = [s for s in self._by_ttl.values() if not s.dead and s.users > 0]
        stale = [s for s in alive if now >= s.acked_at + s.interval]
        if stale:
            try:
                await self.keep_alive(stale, after=now)
            except Exception as exc:
                logger.debug("keep-alive failed, will retry: %r", exc)
                due = self._now() + 0.05
        for session in alive:
            due = min(due, session.acked_at + session.interval)
        return due

    async def revoke_idle(self, now: float) -> float:
        """Revoke each session nobody has used for ``granted`` seconds at ``now``; returns
        when the next idle one is due."""
        due = math.inf
        for session in list(self._by_ttl.values()):
            idle = session.idle_since
            if session.users <= 0 and idle is not None and now - idle >= session.granted:
                del self._by_ttl[session.ttl]
                session.dead = True
                try:
                    await self._client.revoke(session.lease_id)
                except Exception as exc:
                    logger.debug("revoke of lease %x failed: %r", session.lease_id, exc)
            elif session.users <= 0 and idle is not None:
                due = min(due, idle + session.granted)
        return due

    async def revoke_all(self) -> None:
        """Revoke every session (closing); forgotten even if that is cut short."""
        try:
            for session in list(self._by_ttl.values()):
                try:
                    await self._client.revoke(session.lease_id)
                except Exception as exc:
                    logger.debug("revoke of lease %x failed: %r", session.lease_id, exc)
        finally:
            self._by_ttl.clear()


@dataclass(frozen=True, slots=True)
class Predecessor:
    """An etcd waiter's :attr:`Busy.cursor <asynclock.Driver>`: the key its own key queues
    behind and the revision the failed attempt read; its watch starts just after it, so a
    release in between is not missed."""

    owner: str
    key: bytes
    revision: int


@dataclass(eq=False)
class _Slot:
    """This process's one participant in etcd for a name."""

    name: str
    owner: str
    ttl: float
    session: Session | None = None
    key: bytes = b""  # our key (named after the session it was created on)
    rev: int | None = None  # our key's create revision, once known
    held: bool = False
    expires_at: float = math.inf  # held: when the core's lease would have ended
    watch: tuple[bytes, int, int] | None = None  # (watched key, start revision, watch id)
    holder_lease: int = 0  # the etcd lease of the holder seen by the last attempt
    seen_at: int = 0  # a revision at which our key was seen to exist
    gone: bool = False  # held: the deletions watch saw our key deleted after seen_at
    releasing: bool = False  # our own delete of the key is in flight
