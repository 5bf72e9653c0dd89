"""What ``redis+sentinel://`` and ``redis+cluster://`` share: a driver per primary, and a
driver that routes each name to its primary's.

:class:`PrimaryDriver` is the one-server driver (:class:`~.single.RedisDriver`: scripts,
fair queue, pub/sub, restart detection) for one primary, with ``WAIT`` after its grants
(:mod:`.replication`) and, on a cluster, epoch keys per hash slot. :class:`Routed` sends
each call to the primary of its name, keeps which primary granted each lease, and retires a
primary that was replaced: every lease it granted is lost at once, *before* its successor
grants anything (the switch and the losses happen with no await between them), and the
waiters watching there move to the successor. A grant that arrives from a primary retired
while it was asked for is given back and asked for again. Semaphore permits and read-write
holds are routed the same way, and lost the same way (:mod:`.routed_holds`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.abc
import redis.exceptions

from ..._core.driver import Busy, Driver, ExtendResult, LeaseRef, Record, Refused
from ..._core.exceptions import BackendUnavailable
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .keys import KeyCache
from .options import NodeURL
from .replication import ReplicatedNode, Restarted, Wait
from .replies import extend_call, extend_result, holder_from_reply, info_fields
from .routed_holds import RoutedPermits, RoutedRW
from .single import RedisDriver
from .wire import pack

logger = logging.getLogger("asynclock.redis")

#: Attempts at one call when the primary changes under it (MOVED, a failover, READONLY, a
#: slot being migrated: TRYAGAIN).
ATTEMPTS = 8


class PrimaryDriver(RedisDriver):
    """The one-server driver for one primary of a deployment (see the module docstring)."""

    node: ReplicatedNode

    def __init__(
        self,
        url: NodeURL,
        *,
        address: str,
        wait: Wait | None,
        keys: KeyCache | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, **options)
        node = ReplicatedNode(
            url,
            socket_timeout=self.node.socket_timeout,
            connect_timeout=self.node.connect_timeout,
            options=self.node.options,
        )
        node.wait = wait
        self.node = self.listener.node = node
        if keys is not None:  # shared by a cluster's primaries (it counts their leases)
            self.keys = keys
        self.address = address
        self.role = ""
        self.replid = self.replid2 = ""
        #: Replaced by another primary: every lease it granted is lost.
        self.retired = False
        #: Cancels its pub/sub listener (the routed driver's task group runs it).
        self.scope: anyio.CancelScope | None = None
        #: Epoch keys (hash slots, or the database) ADOPT ran for on this primary.
        self.adopted_slots: set[int] = set()
        #: Its pub/sub connection is up (a cluster reads its layout more often when not).
        self.healthy = True
        #: The server behind the address restarted: read it again and ADOPT again.
        self.stale = False
        #: A restart was seen here (ADOPT then marks data that survived it).
        self.restarted = False
        node.on_restart = self._restarted

    def _restarted(self, run_id: str) -> None:
        """A new command connection found another server here (a restart, maybe from a
        replica's stale copy): every lease of the old one is lost, now."""
        before, self.node.run_id = self.node.run_id, run_id
        self.stale = True
        why = (
            f"the Redis server at {self.address} restarted (run_id {before} is now {run_id}); "
            "the leases it granted are gone"
        )
        self._restart_note = why
        for owner, (name, _) in list(self._leases.items()):
            del self._leases[owner]
            self._notify_lost(name, owner, why)
        self._renew_now()

    def _on_connect(self, run_id: str | None, reconnected: bool) -> None:
        if run_id is not None and self.node.run_id not in (None, run_id):
            self.stale = True  # the pub/sub connection saw the restart first
        super()._on_connect(run_id, reconnected)

    async def identify(self) -> None:
        """Read the server's role, replication ids and ``run_id`` (``INFO``)."""
        node = self.node
        try:
            info = info_fields(await node.call(pack(b"INFO"), node.deadline()))
        except Exception as exc:
            raise node.error("INFO", exc) from exc
        self.role = info.get("role", "")
        self.replid = info.get("master_replid", "")
        self.replid2 = info.get("master_replid2", "")
        node.run_id = info.get("run_id") or node.run_id

    async def adopt(self, slot: int, epoch: bytes, era: bytes) -> None:
        """ADOPT (see the script) for one epoch key, once per server: before the first
        grant there, mark a failover the data came through. After a restart the server is
        read again (it may have come back as a replica, or with a replica's old data)."""
        if self.stale:
            self.adopted_slots.clear()
            self.restarted = True
            await self.identify()
            self.stale = self.role != "master"  # read again next time until it is one
        if self.role != "master":
            raise NotPrimary(f"{self.display}: the server is a {self.role} now, not a primary")
        if slot in self.adopted_slots:
            return
        args = (self.replid.encode(), self.replid2.encode(), b"1" if self.restarted else b"0")
        marked = await self.node.run("adopt", (epoch, era), args)
        self.adopted_slots.add(slot)
        if marked:
            logger.warning(
                "%s: the data may lack the last grants of the server before (a promoted "
                "replica, master_replid2 %s, or a restart with its data): a restart grace "
                "starts now, and every token from now on is above the old ones",
                self.display,
                self.replid2,
            )

    async def holder(self, name: str) -> Holder | None:
        # The name's own epoch key (a cluster's is its slot's), not the database's.
        k = self.keys(name)
        return holder_from_reply(
            name, await self.node.run("holder", (k.lock, k.acquire_keys[4]), ())
        )

    def describe(self) -> str:
        run_id = self.node.run_id or "unknown"
        return f"{self.address} (run_id {run_id})"


class NotPrimary(BackendUnavailable):
    """The server at a primary's address is not a primary (any more)."""


def cause(exc: BaseException) -> str:
    """The server's error text behind a driver error (MOVED …, READONLY …), or ""."""
    seen = exc
    while seen is not None:
        if isinstance(seen, redis.exceptions.ResponseError):
            return str(seen)
        seen = seen.__cause__  # type: ignore[assignment]
    return ""


class Routed(Driver):
    """A driver that routes each name to the primary that serves it (see the module)."""

    remote = True
    #: Attempts at one call (see :data:`ATTEMPTS`).
    attempts = ATTEMPTS

    def __init__(self, display: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.display = display
        #: PrimaryDriver keyword options (timeouts, prefix, fair, restart_grace, redis-py's).
        self.primary_options = {k: v for k, v in options.items() if k != "wait"}
        self.wait: Wait | None = options.get("wait")
        self.prefix: str = options.get("prefix", "asynclock:")
        # As one server's driver: with the fair queue a release wakes only the waiter it
        # hands the name to (through the primary's listener).
        self.wakes_waiters = bool(options.get("fair", True))
        #: owner -> (name, token, the primary that holds it).
        self._held: dict[str, tuple[str, int, PrimaryDriver]] = {}
        #: owner -> (lease name, the primary that granted it): permits, read-write holds.
        self.holds: dict[str, tuple[str, PrimaryDriver]] = {}
        #: name -> the primaries each running wait watches it on.
        self._watches: dict[str, list[PrimaryDriver]] = {}
        #: owner -> the primary its queued attempt joined.
        self._queued: dict[str, PrimaryDriver] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._pending: list[PrimaryDriver] = []
        self._open = False

    # -- what each deployment says -----------------------------------------------------------

    async def route(self, name: str) -> PrimaryDriver:
        """The primary serving ``name`` now (waits for a switch in progress)."""
        raise NotImplementedError

    def route_now(self, name: str) -> PrimaryDriver:
        """The primary serving ``name`` as far as known now (no I/O)."""
        raise NotImplementedError

    async def redirected(self, exc: BaseException, primary: PrimaryDriver) -> bool:
        """``exc`` came from ``primary``: True if the call should go again (the deployment
        moved the name: MOVED, a failover seen, READONLY), after updating the routes."""
        return False

    def migrating(self, exc: BaseException) -> bool:
        """``exc`` says the name's slot is being migrated (a cluster's ``ASK``)."""
        return False

    async def again(self, exc: BaseException, primary: PrimaryDriver) -> bool:
        """Should the call that raised ``exc`` go again? (A restart caught up with: yes.)"""
        if isinstance(exc, Restarted):
            return True
        return await self.redirected(exc, primary)

    def primaries(self) -> list[PrimaryDriver]:
        """Every live primary."""
        raise NotImplementedError

    async def watcher(self) -> None:
        """The deployment's own background work (sentinels, the cluster's topology)."""
        await anyio.sleep_forever()

    # -- primaries -------------------------------------------------------------------------

    def make_primary(
        self, url: NodeURL, address: str, keys: KeyCache | None = None
    ) -> PrimaryDriver:
        p = PrimaryDriver(url, address=address, wait=self.wait, keys=keys, **self.primary_options)
        p.bind(self.clock, self._wake, self._lost_on, self._renew_now)
        return p

    def start(self, p: PrimaryDriver) -> None:
        """Run ``p``'s pub/sub listener in the background (now, or once it starts)."""
        if self._tg is None:
            self._pending.append(p)
            return
        p.scope = anyio.CancelScope()
        self._tg.start_soon(self._run_primary, p, p.scope)

    @staticmethod
    async def _run_primary(p: PrimaryDriver, scope: anyio.CancelScope) -> None:
        with scope:
            await p.background()

    async def retire(self, p: PrimaryDriver, successor: PrimaryDriver | None, why: str) -> None:
        """``p`` no longer serves: lose every lease it granted (now, before its successor
        grants: no await before this point in the caller), move its watches, close it."""
        p.retired = True
        self.lose(p, why)
        if p.scope is not None:
            p.scope.cancel()
        for name, on in list(self._watches.items()):
            moved = [q for q in on if q is p]
            if not moved:
                continue
            target = successor or self.route_now(name)
            self._watches[name] = [target if q is p else q for q in on]
            for _ in moved:
                try:
                    await target.watch(name)
                except Exception as exc:  # the next attempt says what is wrong
                    logger.debug("watch of %r on %s failed: %r", name, target.display, exc)
            self._wake(name)  # a release there may have been missed: ask again
        for owner, q in list(self._queued.items()):
            if q is p:
                del self._queued[owner]
        await p.aclose()

    def lose(self, p: PrimaryDriver, why: str) -> None:
        """Every lease ``p`` granted is lost (the holders are cancelled at once)."""
        for owner, (name, _, q) in list(self._held.items()):
            if q is p:
                del self._held[owner]
                p.forget(owner)
                self._notify_lost(name, owner, why)
        for owner, (name, q) in list(self.holds.items()):
            if q is p:
                del self.holds[owner]
                p.forget(owner)
                self._notify_lost(name, owner, why)

    def _lost_on(self, name: str, owner: str, why: str) -> None:
        """A primary's own loss report (it restarted): forget the lease here too."""
        self._held.pop(owner, None)
        self.holds.pop(owner, None)
        self._notify_lost(name, owner, why)

    # -- lifecycle -------------------------------------------------------------------------

    async def background(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            pending, self._pending = self._pending, []
            for p in pending:
                self.start(p)
            await self.watcher()

    async def aclose(self) -> None:
        self._open = False
        for p in self.primaries():
            await p.aclose()

    # -- primitives ------------------------------------------------------------------------

    async def _call(self, name: str, what: str, call: Any) -> Any:
        """``call(primary)`` on the primary of ``name``, again if the name moved."""
        for attempt in range(ATTEMPTS):
            p = await self.route(name)
            try:
                return await call(p)
            except BackendUnavailable as exc:
                if attempt + 1 < ATTEMPTS and await self.again(exc, p):
                    continue
                raise
        raise BackendUnavailable(f"{self.display}: {what} of {name!r}: the primary kept moving")

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        for attempt in range(ATTEMPTS):
            p = await self.route(name)
            try:
                await self.before_grant(p, name)
                result = await p.acquire(name, owner, ttl, queue=queue, scope=scope)
            except BackendUnavailable as exc:
                if attempt + 1 < ATTEMPTS and await self.again(exc, p):
                    continue
                raise
            if p.retired:
                # Replaced while we asked: what it granted is lost with it. Give it back
                # there (best effort: it may still be a writable primary) and ask again.
                if not isinstance(result, Busy):
                    self.give_back(p, partial(p.release, name, owner, None))
                continue
            if isinstance(result, Busy):
                if queue:
                    self._queued[owner] = p
                return result
            self._queued.pop(owner, None)
            self._held[owner] = (name, result, p)
            return result
        raise BackendUnavailable(f"{self.display}: acquire of {name!r}: the primary kept moving")

    async def before_grant(self, p: PrimaryDriver, name: str) -> None:
        """What must happen on ``p`` before it may grant ``name`` (ADOPT)."""

    def give_back(self, p: PrimaryDriver, call: Callable[[], Awaitable[object]]) -> None:
        """A grant from ``p``, retired while it was asked for: ``call()`` gives it back
        there, in the background (best effort: it may still be a writable primary)."""
        if self._tg is not None:
            self._tg.start_soon(self._give_back, p, call)

    @staticmethod
    async def _give_back(p: PrimaryDriver, call: Callable[[], Awaitable[object]]) -> None:
        with anyio.move_on_after(p.node.socket_timeout):
            try:
                await call()
            except Exception as exc:
                logger.debug("a give-back on retired %s failed: %r", p.display, exc)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        if not leases:
            return []
        results: list[ExtendResult | None] = [None] * len(leases)
        groups: dict[int, tuple[PrimaryDriver, list[int]]] = {}
        for i, ref in enumerate(leases):
            held = self._held.get(ref.owner)
            try:
                # A lease granted here renews where it is held; any other, where its name is.
                p = held[2] if held is not None else self.route_now(ref.name)
            except BackendUnavailable as exc:
                results[i] = exc
                continue
            if p.retired:
                results[i] = Refused(f"{p.describe()} was replaced (failover)")
                continue
            groups.setdefault(id(p), (p, []))[1].append(i)

        async def one(p: PrimaryDriver, indexes: list[int]) -> None:
            refs = [leases[i] for i in indexes]
            for i, result in zip(indexes, await self.extend_on(p, refs), strict=True):
                results[i] = result
                ref = leases[i]
                held = self._held.get(ref.owner)
                if isinstance(result, Refused) and held is not None and held[1] == ref.token:
                    del self._held[ref.owner]  # lost: the core drops it
                    held[2].forget(ref.owner)

        if len(groups) == 1:
            await one(*next(iter(groups.values())))
        else:
            async with anyio.create_task_group() as tg:
                for p, indexes in groups.values():
                    tg.start_soon(one, p, indexes)
        self.renewed()
        return [r if r is not None else BackendUnavailable("not renewed") for r in results]

    def renewed(self) -> None:
        """A renewal round was made (the sentinel driver asks the sentinels then)."""

    async def extend_on(self, p: PrimaryDriver, refs: Sequence[LeaseRef]) -> list[ExtendResult]:
        """Renew ``refs``, all granted by ``p``, in one script (+ WAIT)."""
        keys, args = extend_call(p.keys, refs)
        node = p.node
        try:
            if node.wait is None:
                reply, acked = await node.run("extend", keys, args), None
            else:
                reply, acked = await node.run_waited("extend", keys, args)
        except Exception as exc:
            if await self.again(exc, p):
                return [BackendUnavailable(f"{p.display}: moved; renewed again soon")] * len(refs)
            return [exc] * len(refs)  # unknown: the core retries until the deadline
        results = [extend_result(int(code)) for code in reply]
        return self.confirmed(p, results, acked)

    @staticmethod
    def confirmed(
        p: PrimaryDriver, results: list[ExtendResult], acked: int | None
    ) -> list[ExtendResult]:
        """A renewal the replicas did not confirm is not a renewal (nor a refusal)."""
        wait = p.node.wait
        if acked is None or wait is None or int(acked) >= wait.replicas:
            return results
        failure = wait.failure(p.node.display, "the renewal", int(acked))
        return [failure if r is True else r for r in results]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        held = self._held.pop(owner, None)
        if held is not None and held[2].retired:
            return False  # lost with the primary that granted it
        return bool(await self._call(name, "release", lambda p: p.release(name, owner, token)))

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        return RoutedPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        return RoutedRW(self, name)

    async def validate(self, name: str, token: int) -> bool:
        return bool(await self._call(name, "validate", lambda p: p.validate(name, token)))

    async def abandon(self, name: str, owner: str) -> None:
        p = self._queued.pop(owner, None)
        if p is not None and not p.retired:
            await p.abandon(name, owner)

    async def watch(self, name: str, cursor: object = None) -> bool:
        p = self.route_now(name)
        self._watches.setdefault(name, []).append(p)
        return await p.watch(name, cursor)

    async def unwatch(self, name: str) -> None:
        on = self._watches.get(name)
        if not on:
            return
        p = on.pop()
        if not on:
            del self._watches[name]
        if not p.retired:
            await p.unwatch(name)

    async def holder(self, name: str) -> Holder | None:
        found: Holder | None = await self._call(name, "holder", lambda p: p.holder(name))
        return found

    async def break_lock(self, name: str) -> bool:
        return bool(await self._call(name, "break_lock", lambda p: p.break_lock(name)))

    async def names(self) -> list[str]:
        return sorted({n for p in self.primaries() for n in await p.names()})

    async def hold_names(self) -> tuple[list[str], list[str]]:
        found = [await p.hold_names() for p in self.primaries()]
        return sorted({n for s, _ in found for n in s}), sorted({n for _, r in found for n in r})

    async def record_get(self, name: str) -> Record | None:
        record: Record | None = await self._call(name, "record_get", lambda p: p.record_get(name))
        return record

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        call = lambda p: p.record_put(name, owner, token, payload, keep)  # noqa: E731
        return bool(await self._call(name, "record_put", call))

    async def record_delete(self, name: str, token: int) -> bool:
        return bool(await self._call(name, "record_delete", lambda p: p.record_delete(name, token)))
