"""The ZooKeeper driver: kazoo's lock recipe, one session per backend, czxid tokens.

* **Recipe.** A lock ``NAME`` is the znode ``<prefix>/NAME``; each attempt creates an
  ephemeral sequential child ``<owner id>__lock__<seq>`` (kazoo's layout) and lists the
  children in the same pipelined round trip. The lowest contender holds (any child ending
  in a 10-digit sequence is a contender: kazoo's, Curator's and aiozk's nodes too). A
  blocking waiter keeps its node and watches only its predecessor (FIFO, no herd).
* **Token.** From the holder node's ``czxid``: the ensemble's transaction id of its
  creation, larger than every earlier one (G2), whatever the name or token scope, on top
  of the wipe marker's base (:mod:`._era`: above the tokens from before a data loss, and
  the restart grace after one).
* **Liveness.** ZooKeeper keeps an ephemeral node as long as the session lives, not for a
  ttl, so a renewal writes nothing: one ``sync`` round trip renews every lease of the
  backend at once (the session is alive; O(1) per call whatever the number held), and
  each lease keeps its own ttl and local deadline here. A held node is watched: deleted
  behind our back (``break``), its lease is lost at once. A hold the core stops renewing
  is deleted by the driver once its ttl has passed (the session lives on for the
  others). The server ends a session it has not heard from for the negotiated session
  timeout: when the connection is lost (kazoo: SUSPENDED), every holder is cancelled at
  ``last contact + timeout x (1 - drift) - margin``, before the server can expire the
  session and hand the name on (G3); a reconnect in time keeps them. A session lost
  (expired) loses every lease on it at once (G4): that is what a session means.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

import anyio

from ..._core.driver import SENT_AT, Busy, ExtendResult, LeaseRef, Refused
from ..._core.errors import ErrorMapper, map_errors
from ..._core.exceptions import BackendUnavailable
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .._common.asyncio_only import require_asyncio
from . import _paths
from ._era import Eras
from ._held import HeldNodes
from ._inspect import Inspect
from ._kazoo import NodeExistsError, NoNodeError, SessionExpiredError, Zk
from ._nodes import DRIFT, MARGIN, HeldLocks, Node, encode_data, explain
from ._rw import ZkRW
from ._sem import ZkPermits
from ._watches import Behind

logger = logging.getLogger("asynclock.zookeeper")
#: See ``ZooKeeperDriver._slots``.
IN_FLIGHT = 64
T = TypeVar("T")


class ZooKeeperDriver(Inspect):
    """Locks in a ZooKeeper ensemble. See the module docstring and docs/backends/zookeeper.md."""

    remote = True
    queues_locally = True  # at most IN_FLIGHT requests out; acquire sets SENT_AT
    renew_chunk = None  # one round trip renews every lease (the session)
    #: A deleted node wakes only the local waiter right behind it (``_wake_behind``).
    wakes_waiters = True

    def __init__(
        self,
        zk_factory: Callable[[Callable[[str], None]], Zk],
        *,
        prefix: str,
        chroot: str,
        timeout: float,
        display: str,
        secret: str | None,
        restart_grace: float | None = None,
    ) -> None:
        super().__init__()
        self.zk = zk_factory(self._on_state)
        self.prefix = prefix
        self.chroot = chroot
        self.timeout = timeout
        self.display = display
        self.errors: ErrorMapper = map_errors(display, secret, explain=explain)
        self.held = HeldLocks()  # owner -> held node
        #: owner -> (name, node path, czxid) of a queued waiter's node
        self.waiting: dict[str, tuple[str, str, int]] = {}
        #: Nodes to delete once the server answers: node path, or (lock path, owner).
        self._orphans: set[str | tuple[str, str]] = set()
        #: Semaphore permits, read-write holds and intents (nodes of the same session).
        self.nodes = HeldNodes(self)
        #: Requests in flight at once on the one connection: thousands sent together
        #: would each wait behind the others past their deadline (kazoo answers a few
        #: thousand a second); the rest wait here, for a slot, within their own timeout.
        self._slots = anyio.CapacityLimiter(IN_FLIGHT)
        self._armed = {}
        self._behind = {}
        self._unwatched = {}
        self.last_contact: float | None = None
        self._suspended = False
        self._deadline_scope: anyio.CancelScope | None = None
        self._poke = anyio.Event()
        self._suspend_event = anyio.Event()
        self._state_changed = anyio.Event()
        #: The wipe marker: token base, data loss, restart grace.
        self.eras = Eras(self, restart_grace)
        self._refused = False  # a server refused our session since it was last connected

    # -- calls ------------------------------------------------------------------------------

    def _contact(self, t_send: float) -> None:
        if self.last_contact is None or t_send > self.last_contact:
            self.last_contact = t_send

    async def _new_session(self) -> None:
        """A call failed with SessionExpiredError: kazoo is opening a new session (the old
        one's holders are lost through the state listener). Wait for it, within the
        caller's deadline (every state change kazoo reports wakes this to look again)."""
        while self.zk.client.state != "CONNECTED":
            await self._state_changed.wait()

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        # The deadline runs from when the request goes out, not while it waits for a slot
        # behind our own others (that wait is bounded by the caller's timeout).
        async with self._slots:
            return await self._call_now(what, call)

    async def _call_now(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        with self.errors(what):
            with anyio.fail_after(self.timeout):
                for attempt in (1, 2):
                    t_send = self.clock.now()
                    SENT_AT.set(t_send)
                    try:
                        result = await call()
                    except SessionExpiredError:
                        if attempt == 2:
                            raise
                        await self._new_session()
                        continue
                    self._contact(t_send)
                    return result
        raise AssertionError("unreachable")  # pragma: no cover

    def lock_path(self, name: str) -> str:
        return _paths.lock_path(self.prefix, name)

    @property
    def session_timeout(self) -> float:
        """The session timeout the server negotiated, seconds (the requested one until
        a session exists; the server only ever lowers or raises it within its bounds)."""
        ms = self.zk.negotiated_ms if self.zk.negotiated_ms is not None else self.zk.requested_ms
        return ms / 1000

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        require_asyncio(self.display, "the kazoo bridge")
        self.zk.bind_loop()
        try:
            await anyio.to_thread.run_sync(self.zk.start, self.timeout)
        except Exception as exc:
            await anyio.to_thread.run_sync(self.zk.stop)
            raise self.errors.unavailable("cannot connect", exc) from None
        self.last_contact = self.clock.now()
        try:
            found = await self._call("checking the chroot", partial(self.zk.exists, "/"))
            if found is None:
                raise BackendUnavailable(
                    f"{self.display}: the chroot {self.chroot} does not exist on the "
                    f"ensemble; create it first (zkCli.sh create {self.chroot}) or leave it "
                    "out of the URL"
                )
            await self._call("reading the chroot", partial(self.zk.children, "/"))
            await self.eras.current()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.zk.stop)
            raise

    async def aclose(self) -> None:
        if self._releases is not None:  # releases still queued fail (their nodes go below)
            self._releases.close(f"{self.display} was closed")
        with anyio.CancelScope(shield=True):
            try:
                # Closing the session deletes its ephemeral nodes at the server at once.
                with anyio.move_on_after(self.timeout):
                    await anyio.to_thread.run_sync(self.zk.stop, abandon_on_cancel=True)
            except Exception as exc:  # pragma: no cover - must not raise
                logger.debug("closing the ZooKeeper client failed: %r", exc)

    # -- session states (called on the loop from kazoo's listener) -------------------------

    def _on_state(self, state: str) -> None:
        self._state_changed.set()
        self._state_changed = anyio.Event()
        if state == "suspended":
            self._suspended = True
            self._suspend_event.set()
            self._poke.set()
        elif state == "refused":
            self._refused = True
        elif state == "connected":
            self._suspended = False
            self._refused = False
            if self._deadline_scope is not None:
                self._deadline_scope.cancel()
            for owner, (name, _, _) in list(self.waiting.items()):
                self._wake(name, owner)  # a watch may have been missed while away
            for owner, node in list(self._unwatched.items()):
                del self._unwatched[owner]
                self._watch_held(owner, node)
            self.nodes.rewatch()
            self.eras.session_opened()
            self._poke.set()
        elif state == "lost":
            self._suspended = False
            if self._deadline_scope is not None:
                self._deadline_scope.cancel()
            why = "the ZooKeeper session expired"
            if self._refused:
                why += (
                    " (the server refused to resume it: it had not seen our last "
                    "transaction, so its data is older than ours: wiped or restored)"
                )
            self._data_lost(why)

    def _data_lost(self, why: str) -> None:
        """Every node of ours is gone at the server (the session ended, or the data)."""
        self._lose_all(why)
        self.nodes.lose_all(why, keep=False)
        self.nodes.limits.clear()
        for owner, (name, _, _) in list(self.waiting.items()):
            del self.waiting[owner]  # its node went with the session
            self._wake(name, owner)
        self._orphans.clear()  # every node of the old session is gone
        self._armed.clear()  # and every watch
        self._behind.clear()
        self._unwatched.clear()

    def _lose_all(self, why: str) -> None:
        for owner, node in list(self.held.items()):
            del self.held[owner]
            self._notify_lost(node.name, owner, why)
            self._wake_behind(node.path)

    async def background(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_suspension)
            tg.start_soon(self._housekeeping)
            tg.start_soon(self.eras.watch)

    async def _watch_suspension(self) -> None:
        """While the connection is lost, cancel every holder at the session deadline."""
        while True:
            await self._suspend_event.wait()
            self._suspend_event = anyio.Event()
            if not self._suspended:
                continue
            last = self.last_contact if self.last_contact is not None else self.clock.now()
            deadline = last + self.session_timeout * (1 - DRIFT) - MARGIN
            with anyio.CancelScope() as scope:
                self._deadline_scope = scope
                await anyio.sleep(max(0.0, deadline - self.clock.now()))
                if self._suspended:
                    for node in self.held.values():
                        self._orphans.add(node.path)  # the session may yet come back
                    why = (
                        "connection to ZooKeeper lost: the session may expire at the "
                        f"server {self.session_timeout:g}s after the last contact"
                    )
                    self._lose_all(why)
                    self.nodes.lose_all(why, keep=True)
            self._deadline_scope = None

    async def _housekeeping(self) -> None:
        """Keep our last contact fresh while we hold, expire holds the core stopped
        renewing, delete orphans."""
        while True:
            now = self.clock.now()
            due = now + self.session_timeout / 3
            if not self._suspended:
                for node in self.held.expire(now):  # the core stopped renewing them
                    self._orphans.add(node.path)
                    self._wake_behind(node.path)
                due = min(due, self.held.due, self.nodes.expire(now))
                last = self.last_contact if self.last_contact is not None else now
                ping_at = last + self.session_timeout / 3
                holding = bool(self.held or self.nodes.entries)
                if holding and now >= ping_at:
                    try:
                        await self._call("ping", partial(self.zk.exists, "/"))
                    except Exception as exc:
                        logger.debug("ping failed: %r", exc)
                elif holding:
                    due = min(due, ping_at)
                if not await self.nodes.clean():
                    due = min(due, self.clock.now() + 0.2)
                for owner, node in list(self._unwatched.items()):
                    del self._unwatched[owner]
                    self._watch_held(owner, node)
                for orphan in list(self._orphans):
                    try:
                        await self._delete_orphan(orphan)
                    except Exception as exc:
                        logger.debug("delete of %r failed, will retry: %r", orphan, exc)
                        due = min(due, self.clock.now() + 0.2)
                    else:
                        self._orphans.discard(orphan)
            self._poke = anyio.Event()
            with anyio.move_on_after(max(0.0, due - self.clock.now())):
                await self._poke.wait()

    # -- acquire ----------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        # scope: a czxid is above every earlier czxid of the ensemble, so above every
        # token of any name or scope (G2 for both).
        lock = self.lock_path(name)
        era = await self.eras.current()
        grace = self.eras.busy(era, ttl)
        if grace is not None:
            return grace
        session = self.zk.session_id  # the nodes made below live as long as this session
        waiting = self.waiting.get(owner)
        if waiting is not None:  # a queued waiter: is its node first now?
            _, path, czxid = waiting
            children = await self._call(f"acquire of {name!r}", partial(self.zk.children, lock))
            if path.rpartition("/")[2] not in children:  # deleted (broken): queue again
                self.waiting.pop(owner, None)
                return await self.acquire(name, owner, ttl, queue=queue, scope=scope)
        else:
            path, czxid, children = await self._create(name, lock, owner, ttl)
        if not self.eras.holds(era, session):  # a new session meanwhile: its era first
            self._orphans.add(path)
            self.waiting.pop(owner, None)
            return await self.acquire(name, owner, ttl, queue=queue, scope=scope)
        token = era.token(czxid)
        t_send = SENT_AT.get()  # when the request went out, after any wait for a slot
        self._contact(t_send)
        index, nearest, first = _paths.ahead_of(children, path.rpartition("/")[2])
        if index == 0:
            self.waiting.pop(owner, None)
            node = Node(name, owner, path, token, ttl, t_send + ttl, session)
            self.held.add(owner, node)
            self._watch_held(owner, node)
            self._poke.set()
            return token
        predecessor = f"{lock}/{nearest}"
        detail = f"held by node {first} ({index} ahead in the queue)"
        if queue:
            self.waiting[owner] = (name, path, czxid)
            # Every wake-up of a waiter watches the node in front again, whatever woke it
            # (a watch fires once: a write to that node fires it as "changed").
            if await self._arm(name, predecessor, owner):  # gone already: look again
                return await self.acquire(name, owner, ttl, queue=queue, scope=scope)
            cursor = Behind(owner, predecessor)
            return Busy(retry_after=self.session_timeout, detail=detail, cursor=cursor)
        self.waiting.pop(owner, None)
        try:
            await self._delete(path)
        except BaseException:
            self._orphans.add(path)
            self._poke.set()
            raise
        # How long the holder has left is not known without asking (its ttl is in its
        # node; a crashed holder's node lasts until its session expires).
        return Busy(detail=detail)

    async def _create(
        self, name: str, lock: str, owner: str, ttl: float
    ) -> tuple[str, int, list[str]]:
        """Create our node and list the children in one pipelined round trip."""
        node = f"{lock}/{owner[:32]}{_paths.MARK}"
        data = encode_data(owner, ttl)
        async with self._slots:  # see _call
            return await self._create_now(name, lock, node, data)

    async def _create_now(
        self, name: str, lock: str, node: str, data: bytes
    ) -> tuple[str, int, list[str]]:
        with self.errors(f"acquire of {name!r} failed"):
            with anyio.fail_after(self.timeout):
                for attempt in (1, 2, 3):
                    SENT_AT.set(self.clock.now())
                    created, listed = await self.zk.create_and_list(node, data, lock)
                    try:
                        if isinstance(created, BaseException):
                            raise created
                        path, stat = created
                    except SessionExpiredError:
                        if attempt == 3:
                            raise
                        await self._new_session()
                        continue
                    except NoNodeError:
                        if attempt == 3:
                            raise
                        with contextlib.suppress(NodeExistsError):
                            await self.zk.ensure_path(lock)
                        continue
                    if isinstance(listed, BaseException):
                        raise listed
                    return path, stat.czxid, listed
        raise AssertionError("unreachable")  # pragma: no cover

    # -- renew, release, validate ------------------------------------------------------------

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        # The session keeps every node of ours: one round trip renews them all (O(1) per
        # call whatever the number of leases). ``sync`` proves the session alive now and
        # delivers first every watch event of a write committed before it (a lock node
        # deleted behind our back is lost through its watch, before this answers).
        t_send = self.clock.now()
        try:
            # Not behind acquisitions waiting for a slot: one request, ahead of them.
            await self._call_now("renewal", self.zk.sync)
        except Exception as exc:
            error = self.errors.unavailable("renewal failed", exc)
            return [error] * len(leases)
        session = self.zk.session_id
        out: list[ExtendResult] = []
        for ref in leases:
            node = self.held.get(ref.owner)
            if node is None or node.token != ref.token or node.name != ref.name:
                out.append(Refused("not held by this owner (its lock node is gone)"))
            elif node.gone:
                del self.held[ref.owner]
                self._wake_behind(node.path)
                out.append(Refused("lock node deleted at the server"))
            elif node.session != session:
                del self.held[ref.owner]
                out.append(Refused("the ZooKeeper session its lock node was made on ended"))
            else:
                node.ttl = ref.ttl
                node.expires_at = max(node.expires_at, t_send + ref.ttl)
                out.append(True)
        return out

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        node = self.held.get(owner)
        if node is not None and node.name == name:
            if token is not None and node.token != token:
                return False
            node.releasing = True
            try:
                removed = await self._delete_held(node.path)  # local state after (G6)
            except BaseException:
                node.releasing = False
                raise
            if self.held.get(owner) is node:
                del self.held[owner]
            self._wake_behind(node.path)
            return removed
        if token is not None:
            return False
        waiting = self.waiting.get(owner)
        if waiting is not None:
            return await self._drop(owner, waiting[1])
        # An interrupted first attempt: its node may exist (the create may have run).
        orphan = (self.lock_path(name), owner)
        try:
            await self._delete_orphan(orphan)
        except BaseException:
            self._orphans.add(orphan)
            self._poke.set()
            raise
        return False

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        return ZkPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        return ZkRW(self, name)

    async def _drop(self, owner: str, path: str) -> bool:
        self.waiting.pop(owner, None)
        try:
            return await self._delete(path)
        except BaseException:
            self._orphans.add(path)
            self._poke.set()
            raise

    async def abandon(self, name: str, owner: str) -> None:
        waiting = self.waiting.get(owner)
        if waiting is not None:
            await self._drop(owner, waiting[1])
            self._wake_behind(waiting[1])


__all__ = ("ZooKeeperDriver",)
