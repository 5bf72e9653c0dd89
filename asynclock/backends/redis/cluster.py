"""``redis+cluster://[user:password@]node1:6379,node2:6379,…`` — Redis Cluster (>= 7.0).

All keys of one name share the hash tag ``{name}``, so each name lives in one slot and each
script runs on that slot's primary. The backend reads the layout with ``CLUSTER NODES``
(from a known primary, else a seed node), sends each call to the primary of its name's slot
and follows ``MOVED`` (the slot moved: read the layout again) and ``ASK`` (the slot is being
migrated: ``ASKING`` and the command on the target, on one connection). Renewals are
batched per node: the leases each primary granted are renewed in one script there
(``CLUSTER_EXTEND``: keys of many slots of one node), the nodes in parallel; a lease whose
slot migrated is renewed on its new primary and stays held.

A primary's failover is a restart, as on Sentinel: when the layout shows it is no longer a
serving primary (failed, demoted to a replica), every lease it granted is lost at once,
before its successor grants, and before the first grant in a slot the successor runs ADOPT
there (each slot has its own epoch and era keys: a restart grace and a token floor per slot).
While a primary is unreachable the layout is read again every 0.25 s, else every few
seconds (a manual ``CLUSTER FAILOVER`` or a migration shows there). ``WAIT`` (the option
``wait_replicas``) goes to the slot owner's connection, after its script.

Semaphores and read-write locks (:mod:`.routed_holds`) keep all their keys and the slot's
epoch key in the name's slot; a grant follows MOVED (it did not run), and ASK is busy.

A token scope's counter lives in its own slot: a scoped acquire takes the name (its own
counter's token), draws the scope's next token above it on the scope's slot, and raises the
lease and the name's counter to that: three round trips instead of one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio

from ..._core.driver import Busy, ExtendResult, LeaseRef, Refused
from ..._core.exceptions import BackendUnavailable
from .._common.urls import parse_multi_host_url
from .base import LOUD
from .deployments import Deployment, read_deployment_url
from .keys import scope_fence_key
from .replication import ASKING
from .replies import extend_result
from .routed import ATTEMPTS, NotPrimary, PrimaryDriver, Routed, cause
from .topology import SLOTS, SlotKeyCache, key_slot, parse_nodes, redirection
from .wire import Node, ms, pack

logger = logging.getLogger("asynclock.redis")

#: Seconds between layout reads while every primary is reachable (and while one is not).
REFRESH_EVERY, REFRESH_UNHEALTHY = 5.0, 0.25


class ClusterDriver(Routed):
    """Locks on a Redis Cluster (see the module docstring)."""

    def __init__(self, dep: Deployment) -> None:
        super().__init__(dep.display, dep.options)
        self.dep = dep
        self.keys = SlotKeyCache(self.prefix)
        self.keys.held = lambda: sum(len(p._leases) for p in self.by_address.values())
        self.owners: list[PrimaryDriver | None] = [None] * SLOTS
        self.by_address: dict[str, PrimaryDriver] = {}
        self.seeds = [
            Node(
                url,
                socket_timeout=dep.options["socket_timeout"],
                connect_timeout=dep.options["connect_timeout"],
                options={},
            )
            for url in dep.seeds
        ]
        self._refresh_due = anyio.Event()
        self._refreshing: anyio.Event | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        try:
            await self.refresh()
        except BaseException:
            await self.aclose()
            raise
        self._open = True

    async def aclose(self) -> None:
        await super().aclose()
        for node in self.seeds:
            await node.aclose()

    def primaries(self) -> list[PrimaryDriver]:
        return list(self.by_address.values())

    # -- the layout ------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the layout now (or wait for the read in progress)."""
        running = self._refreshing
        if running is not None:
            with anyio.move_on_after(self.dep.options["socket_timeout"] * 4):
                await running.wait()
            return
        self._refreshing = done = anyio.Event()
        try:
            await self._refresh()
        finally:
            self._refreshing = None
            done.set()

    async def _layout(self) -> str:
        failures: dict[str, str] = {}
        for node in [p.node for p in self.by_address.values()] + self.seeds:
            try:
                reply = await node.call(pack(b"CLUSTER", b"NODES"), node.deadline())
            except Exception as exc:
                failures[node.display] = node.reason(node.error("CLUSTER NODES", exc))
                continue
            return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
        detail = "; ".join(f"{where}: {why}" for where, why in failures.items())
        raise BackendUnavailable(
            f"{self.display}: no cluster node answered CLUSTER NODES ({detail})"
        )

    async def _refresh(self) -> None:
        layout = parse_nodes(await self._layout())
        serving = {n.address: n for n in layout if n.serving and n.ranges}
        if not serving:
            raise BackendUnavailable(f"{self.display}: the cluster has no primary serving slots")
        opened: dict[str, PrimaryDriver] = {}
        try:
            for address in serving:
                if address not in self.by_address:
                    opened[address] = await self._open_primary(address)
        except BaseException:
            for p in opened.values():
                await p.aclose()
            raise
        known = {**self.by_address, **opened}
        owners: list[PrimaryDriver | None] = [None] * SLOTS
        for address, entry in serving.items():
            for first, last in entry.ranges:
                owners[first : last + 1] = [known[address]] * (last - first + 1)
        gone = [p for address, p in self.by_address.items() if address not in serving]
        # No await from here until the losses are signalled: no successor grants before
        # every holder of a replaced primary is cancelled.
        self.by_address = {address: known[address] for address in serving}
        self.owners = owners
        for p in opened.values():
            self.start(p)
        for p in gone:
            p.retired = True
            self.lose(p, self._why(p, layout))
        for p in gone:
            await self.retire(p, None, "")

    @staticmethod
    def _why(p: PrimaryDriver, layout: Sequence[Any]) -> str:
        entry = next((n for n in layout if n.address == p.address), None)
        now = (
            "gone from the cluster" if entry is None else "flagged " + ",".join(sorted(entry.flags))
        )
        return (
            f"failover: the cluster primary {p.describe()} no longer serves its slots ({now}); "
            "every lease it granted is lost (its successor may lack its last grants)"
        )

    async def _open_primary(self, address: str) -> PrimaryDriver:
        host = parse_multi_host_url(f"redis://{address}").hosts[0]
        assert host.port is not None
        p = self.make_primary(self.dep.node(host.host, host.port), address, keys=self.keys)
        try:
            await p.open()
            await p.identify()
        except BaseException:
            await p.aclose()
            raise
        reset, connected = p.listener.on_reset, p.listener.on_connect

        def on_reset() -> None:  # its connection dropped: is it still a primary?
            reset()
            p.healthy = False
            self._refresh_due.set()

        def on_connect(run_id: str | None, reconnected: bool) -> None:
            p.healthy = True
            if connected is not None:
                connected(run_id, reconnected)

        p.listener.on_reset, p.listener.on_connect = on_reset, on_connect
        p.listener.keep_connected()  # how a node's death is noticed at once
        return p

    async def watcher(self) -> None:
        while True:
            unhealthy = not all(p.healthy for p in self.primaries())
            with anyio.move_on_after(REFRESH_UNHEALTHY if unhealthy else REFRESH_EVERY):
                await self._refresh_due.wait()
            self._refresh_due = anyio.Event()
            try:
                await self.refresh()
            except Exception as exc:
                logger.info("%s: reading the cluster layout failed: %s", self.display, exc)
                await anyio.sleep(REFRESH_UNHEALTHY)
                self._refresh_due.set()

    # -- routing ---------------------------------------------------------------------------

    def slot(self, name: str) -> int:
        return key_slot(self.keys(name).lock)

    def route_now(self, name: str) -> PrimaryDriver:
        p = self.owners[self.slot(name)]
        if p is None:
            raise BackendUnavailable(
                f"{self.display}: no primary serves the slot of {name!r} "
                f"({self.slot(name)}): the cluster is down or being resharded"
            )
        return p

    async def route(self, name: str) -> PrimaryDriver:
        if self.owners[self.slot(name)] is None:
            await self.refresh()
        return self.route_now(name)

    async def redirected(self, exc: BaseException, primary: PrimaryDriver) -> bool:
        text = cause(exc)
        moved = redirection(text)
        if moved is not None and moved[0] == "MOVED":
            _, slot, address = moved
            target = self.by_address.get(address)
            if target is not None and not primary.retired and primary.address in self.by_address:
                self.owners[slot] = target  # a migration: the layout read confirms it
                self._refresh_due.set()
            else:
                await self.refresh()  # a new primary (a failover): lose the old one's first
            return True
        if moved is not None:
            return False  # ASK: the caller's own path (ask()), with ASKING on the target
        if text.startswith(("TRYAGAIN", "CLUSTERDOWN", "READONLY")) or isinstance(exc, NotPrimary):
            # A multi-key call while its slot's keys are split between two nodes (they are
            # being migrated), or a cluster settling after a failover: again shortly.
            self._refresh_due.set()
            await anyio.sleep(0.05)
            return True
        self._refresh_due.set()  # unreachable? the layout may show a failover
        return primary.retired

    def migrating(self, exc: BaseException) -> bool:
        moved = redirection(cause(exc))
        return moved is not None and moved[0] == "ASK"

    async def ask(self, exc: BaseException, call: Any) -> Any:
        """``call(primary)`` on the target of an ``ASK`` in ``exc`` (with ``ASKING``)."""
        moved = redirection(cause(exc))
        if moved is None or moved[0] != "ASK":
            raise exc
        target = self.by_address.get(moved[2])
        if target is None:
            await self.refresh()
            target = self.by_address.get(moved[2])
            if target is None:
                raise exc
        token = ASKING.set(True)
        try:
            return await call(target)
        finally:
            ASKING.reset(token)

    # -- primitives ------------------------------------------------------------------------

    async def before_grant(self, p: PrimaryDriver, name: str) -> None:
        slot = self.slot(name)
        epoch, era = self.keys.slot_keys(slot)
        await p.adopt(slot, epoch, era)

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        try:
            granted = await super().acquire(name, owner, ttl, queue=queue)
        except BackendUnavailable as exc:
            if redirection(cause(exc)) is None:
                raise
            # ASK: the slot is being migrated, keys on both sides: ask again shortly.
            return Busy(0.05, "its hash slot is being migrated", cursor=LOUD)
        if scope is None or isinstance(granted, Busy):
            return granted
        return await self._scoped(name, owner, granted, scope)

    async def _scoped(self, name: str, owner: str, granted: int, scope: str) -> int | Busy:
        """A token scope's counter is in its own slot: the grant's token (from the name's
        counter) is raised above the scope's next one (SCOPE_NEXT, on the scope's slot),
        and the lease and the name's counter take it (RAISE_FENCE), before the acquire
        returns (G2 for both: tokens are fixed in the scope counter's order)."""
        fence = scope_fence_key(scope, self.prefix)
        slot = key_slot(fence)
        epoch, era = self.keys.slot_keys(slot)

        async def scoped(q: PrimaryDriver) -> Any:
            await q.adopt(slot, epoch, era)
            return await q.node.run("scope_next", (fence, epoch), (b"%d" % granted,))

        for attempt in range(ATTEMPTS):
            q = self.owners[slot]
            if q is None:
                await self.refresh()
                continue
            try:
                token = int(await scoped(q))
                break
            except BackendUnavailable as exc:
                if attempt + 1 < ATTEMPTS and await self.again(exc, q):
                    continue
                token = int(await self.ask(exc, scoped))
                break
        else:
            raise BackendUnavailable(f"{self.display}: no primary serves token scope {scope!r}")
        k = self.keys(name)
        name_, _, p = self._held[owner]
        args = (owner.encode(), b"%d" % token)
        if not await p.node.run("raise_fence", (k.lock, k.fence), args):
            # Lost between the steps (expired: a ttl shorter than two round trips).
            await self.release(name, owner, None)
            return Busy(0.0, "the lease ended before its scoped token was set", cursor=LOUD)
        self._held[owner] = (name_, token, p)
        return token

    async def _call(self, name: str, what: str, call: Any) -> Any:
        try:
            return await super()._call(name, what, call)
        except BackendUnavailable as exc:
            return await self.ask(exc, call)

    async def extend_on(
        self, p: PrimaryDriver, refs: Sequence[LeaseRef], depth: int = 0
    ) -> list[ExtendResult]:
        keys = [self.keys(ref.name).lock for ref in refs]
        args: list[bytes] = []
        for key, ref in zip(keys, refs, strict=True):
            args += [key, f"{ref.owner}:{ref.token}".encode(), b"%d" % ms(ref.ttl)]
        try:
            reply, acked = await p.node.run_waited("cluster_extend", keys[:1], args)
        except Exception as exc:
            if depth == 0 and await self.again(exc, p):
                return await self._rehome(refs, depth)
            return [exc] * len(refs)
        results: list[ExtendResult] = []
        moved: list[int] = []
        for i, code in enumerate(reply):
            if int(code) == 2:
                moved.append(i)
                results.append(BackendUnavailable("moved"))
            else:
                results.append(extend_result(int(code)))
        results = self.confirmed(p, results, acked)
        for i, result in enumerate(results):
            if isinstance(result, Refused) and int(reply[i]) == 0:
                results[i] = await self._confirm_gone(p, refs[i])
        if moved and depth == 0:
            self._refresh_due.set()
            await self.refresh()
            again = await self._rehome([refs[i] for i in moved], depth)
            for i, result in zip(moved, again, strict=True):
                results[i] = result
        return results

    async def _rehome(self, refs: Sequence[LeaseRef], depth: int) -> list[ExtendResult]:
        """Renew leases whose slot moved (a migration) on the slot's primary now; they are
        held there from now on."""
        results: list[ExtendResult] = []
        for ref in refs:
            held = self._held.get(ref.owner)
            try:
                q = self.route_now(ref.name)
            except BackendUnavailable as exc:
                results.append(exc)
                continue
            if held is not None and held[2] is not q and not held[2].retired:
                held[2].forget(ref.owner)
                q.adopted(ref.name, ref.owner)
                self._held[ref.owner] = (ref.name, held[1], q)
            results += await self.extend_on(q, [ref], depth + 1)
        return results

    async def _confirm_gone(self, p: PrimaryDriver, ref: LeaseRef) -> ExtendResult:
        """A key CLUSTER_EXTEND found gone, asked again with the key declared: in a slot
        being migrated the key may already be on the target (ASK), and is not gone."""
        k = self.keys(ref.name)
        args = (f"{ref.owner}:{ref.token}".encode(), b"%d" % ms(ref.ttl))

        async def one(q: PrimaryDriver) -> Any:
            return await q.node.run("extend", (k.lock,), args)

        try:
            try:
                reply = await one(p)
            except BackendUnavailable as exc:
                reply = await self.ask(exc, one)
        except Exception as exc:
            return exc
        return extend_result(int(reply[0]))


def driver_from_url(url: str, **options: Any) -> ClusterDriver:
    return ClusterDriver(read_deployment_url(url, options))


__all__ = ("ClusterDriver", "driver_from_url")
