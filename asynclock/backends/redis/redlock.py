"""``redlock://host1:port,host2:port,…`` — N independent Redis servers, quorum ⌊N/2⌋+1.

Every request goes to all nodes at once — written to each node's idle connection in turn,
then each reply read under one shared deadline (a node without an idle connection connects
in a task meanwhile) — bounded by a per-node timeout of ``min(node_timeout, ttl / 3)``, and
waits for every node's answer or timeout, so a failed attempt gives back what it got only
after no late ``SET`` can still land.

**Fencing tokens** (docs/backends/redis.md, "Redlock fencing tokens", has the proof). Phase
1 runs the single-node acquire script, without its waiter queue, on each node: ``SET`` +
``INCR`` of that node's counter. With a quorum, ``t`` is the largest counter returned. If
every granting node returned the same counter, each of them already holds ``t`` and phase 2
is skipped (one round trip, the common case).
Otherwise phase 2 raises each granting node's counter to ``t`` where it still holds our
key, and needs a quorum of acknowledgements. Two valid holders whose windows are ordered
get ordered tokens: their quorums meet at some node, where the later holder's ``INCR`` runs
after the earlier holder's counter reached its token. Assumptions: a node never loses its
counter without re-seeding it from a clock that does not run backwards (persistence, or the
``TIME`` seed), and node clocks run at rates within the drift bound.

URL: ``redlock://[[user]:password@]h1:p1,h2:p2,…[/db][?tls=1]``. Options: ``node_timeout``
(seconds, default 0.25), ``connect_timeout``, ``prefix``, ``restart_grace`` (per node, as
for ``redis://``); others go to redis-py. Every node must be a distinct server: a repeated
address is refused at connect, two addresses of one server (same ``run_id``) at open.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from ..._core.driver import Busy, ExtendResult, LeaseRef, Record, Refused
from ..._core.exceptions import QuorumNotReached
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .._common.asyncio_only import require_asyncio
from .._common.options import check_restart_grace
from .base import LOUD, NO_EXPIRY, QUIET, GraceReport, SubscribingDriver
from .fanout import Fanout, tally
from .keys import scope_fence_key
from .options import NodeURL, check_distinct, parse_url, read_redlock_options
from .pubsub import Listener
from .redlock_release import RedlockReleases
from .replies import extend_call, grace_ms, holder_from_reply
from .wire import Node, ms, pack, pack_script

#: An acquisition that took longer than this fraction of its ttl is given back: the
#: lease would be lost before its first renewal.
MAX_ACQUIRE_FRACTION = 0.5


#: Why redlock:// stores no idempotency records (docs/idempotency.md, "Redlock").
NO_RECORDS = (
    "redlock:// does not store idempotency records: a result written to a majority of "
    "independent nodes is not read back reliably (a later reader's majority may miss a "
    "node that took the write while another lost it in a restart without persistence), "
    "and then the operation runs twice; use one Redis server (redis://), PostgreSQL, "
    "etcd or SQLite for idempotency keys, and Redlock for locks"
)

SEMAPHORES_ELSEWHERE = (
    "backend.semaphore() works on redis:// (one server, Sentinel or Cluster), "
    "postgresql://, etcd://, zookeeper://, sqlite:// and memory://"
)
RWLOCKS_ELSEWHERE = SEMAPHORES_ELSEWHERE.replace("semaphore", "rwlock")


class RedlockDriver(SubscribingDriver):
    """Locks on a quorum of independent Redis nodes (see the module docstring)."""

    # backend.leader() is not offered on Redlock (docs/concepts.md); holder() answers alone.
    tells_owner = False

    def __init__(
        self,
        urls: Sequence[str | NodeURL],
        *,
        display: str,
        node_timeout: float = 0.25,
        connect_timeout: float = 1.0,
        prefix: str = "asynclock:",
        restart_grace: float | None = None,
        **redis_options: Any,
    ) -> None:
        super().__init__(prefix)
        self.restart_grace = check_restart_grace(restart_grace)
        if len(urls) < 1:
            raise ValueError("redlock:// needs at least one node (use 3 or 5)")
        nodes = [url if isinstance(url, NodeURL) else NodeURL.of(url) for url in urls]
        check_distinct(nodes)
        self.nodes = [
            Node(
                url,
                socket_timeout=node_timeout,
                connect_timeout=min(connect_timeout, node_timeout),
                options=dict(redis_options),
            )
            for url in nodes
        ]
        self.quorum = len(self.nodes) // 2 + 1
        self.node_timeout = node_timeout
        self.prefix = prefix
        self.display = display
        self.grace = GraceReport(display)
        self.listeners = [
            Listener(n, self._on_message, self._on_reset, self._on_resumed, self._connected(n))
            for n in self.nodes
        ]
        self.fan = Fanout(self.nodes)
        #: Owners whose acquisition is in progress here (they gave back partial grants):
        #: the release message of such a give-back must not wake their own waiter.
        self._attempting: set[str] = set()
        #: Releases made while one is in flight go out together, one script call per node
        #: per batch (issue 45 item 3: 2,000 blocks exiting at once on a starved machine
        #: made 6,000 replies to read, one task each, and some read theirs past the timeout).
        self._releases = RedlockReleases(
            self.fan, self.keys, self.quorum, node_timeout, display, self._no_quorum
        )

    def _timeout(self, ttl: float) -> float:
        return max(0.001, min(self.node_timeout, ttl / 3))

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        require_asyncio(self.display, "redis-py's asyncio client")

        async def load(node: Node) -> None:
            await node.load()

        results = await self.fan.each(load, max(self.node_timeout, 1.0))
        try:
            self._check_run_ids()
        except ValueError:
            await self.aclose()
            raise
        ok = sum(1 for r in results.values() if not isinstance(r, BaseException))
        if ok < self.quorum:
            raise QuorumNotReached(
                f"{self.display}: only {ok} of {len(self.nodes)} nodes reachable, "
                f"a quorum is {self.quorum}",
                self.fan.failures(results),
            )
        self._open = True

    def _check_run_ids(self) -> None:
        """Refuse two node addresses that reach one server (an alias, a proxy, a NAT):
        its vote would count twice toward the quorum (G1). Each start of a server has
        its own ``run_id``; a node that did not answer is not checked."""
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.run_id is None:
                continue
            first = seen.setdefault(node.run_id, i)
            if first != i:
                raise ValueError(
                    f"{self.display}: nodes {first + 1} and {i + 1} "
                    f"({self.nodes[first].display} and {node.display}) are the same Redis "
                    f"server (run_id {node.run_id}); every node must be a distinct server, "
                    "or one server's vote counts twice toward the quorum"
                )

    async def background(self) -> None:
        async with anyio.create_task_group() as tg:
            for listener in self.listeners:
                tg.start_soon(listener.run)

    async def aclose(self) -> None:
        self._open = False
        self._releases.close("the backend is closed")
        for node in self.nodes:
            await node.aclose()

    # -- primitives ------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        k = self.keys(name)
        # A token scope's counter rides along in phase 1 and phase 2 on every node.
        scope_fence = None if scope is None else scope_fence_key(scope, self.prefix)
        fences = (k.fence,) if scope_fence is None else (k.fence, scope_fence)
        timeout = self._timeout(ttl)
        started = self.clock.now()
        trusted = self._subscribed(k.channel_name)
        # Only a subscribed name's busy answer can be quiet (see below).
        epochs = [listener.epoch for listener in self.listeners] if trusted else None
        heard = self._heard.get(name, 0)
        ownerb = owner.encode()
        if queue:
            self._attempting.add(owner)  # until granted or abandoned (the core calls it)
        ttl_ms = ms(ttl)
        phase1: tuple[bytes, ...] = k.redlock_keys
        if scope_fence is not None:
            phase1 = (*phase1, scope_fence)
        packed = pack_script(
            "redlock_acquire",
            phase1,
            (ownerb, b"%d" % ttl_ms, grace_ms(self.restart_grace, ttl_ms)),
        )
        results = await self.fan.send("redlock_acquire", packed, timeout)
        tokens: dict[int, int] = {}
        # (seconds until that node may grant, its restart grace's end in ms or 0)
        busy: list[tuple[float, int]] = []
        for i, r in results.items():
            if isinstance(r, BaseException):
                continue
            if r[0]:
                tokens[i] = int(r[0])
            else:
                # -1: that node's key has no expiry (inf: it may never free).
                left = math.inf if int(r[1]) == -1 else int(r[1]) / 1000
                busy.append((left, int(r[2]) if len(r) > 2 else 0))
        if len(tokens) >= self.quorum:
            token = max(tokens.values())
            if min(tokens.values()) != token:
                # Phase 2: the quorum disagrees; raise every granting node to t.
                packed = pack_script("raise_fence", (k.lock, *fences), (ownerb, b"%d" % token))
                acks = await self.fan.send("raise_fence", packed, timeout, list(tokens))
                ok = sum(1 for r in acks.values() if r == 1)
                if ok < self.quorum:
                    await self.release(name, owner, None)
                    failures = {**self.fan.failures(results), **self.fan.failures(acks)}
                    if len(failures) > len(self.nodes) - self.quorum:
                        raise self._no_quorum(f"phase 2 of acquire of {name!r}", ok, failures)
                    return Busy(timeout, cursor=LOUD)
            self._attempting.discard(owner)
            for listener in self.listeners:
                listener.keep_connected()  # to notice a node's restart at once
            elapsed = self.clock.now() - started
            if elapsed >= ttl * MAX_ACQUIRE_FRACTION:
                await self.release(name, owner, None)
                raise QuorumNotReached(
                    f"{self.display}: acquire of {name!r} took {elapsed:.3f}s, more than "
                    f"{MAX_ACQUIRE_FRACTION:.0%} of its ttl {ttl:g}s; the lease would be "
                    "lost at once (nodes too slow; raise ttl or lower node_timeout)",
                    self.fan.failures(results),
                )
            return token
        # No quorum: give back what we got (and whatever a node we did not hear from may
        # still grant), then say why.
        if len(busy) < len(self.nodes):
            await self.release(name, owner, None)
        if len(tokens) + len(busy) >= self.quorum and busy:
            needed = self.quorum - len(tokens)
            busy.sort()
            # Subscribed everywhere before we asked, still, and no wake-up came meanwhile:
            # any release after our attempt will reach us as a message.
            quiet = (
                trusted
                and epochs == [listener.epoch for listener in self.listeners]
                and self._subscribed(k.channel_name)
                and self._heard.get(name, 0) == heard
            )
            retry, grace_end = busy[min(needed, len(busy)) - 1]
            if retry == math.inf:
                return NO_EXPIRY
            cursor = QUIET if quiet else LOUD
            if grace_end:  # the quorum waits for a node's restart grace, not a holder
                return self.grace.busy(round(retry * 1000), grace_end, cursor)
            return Busy(retry, cursor=cursor)
        raise self._no_quorum(f"acquire of {name!r}", len(tokens), self.fan.failures(results))

    async def abandon(self, name: str, owner: str) -> None:
        self._attempting.discard(owner)

    def _subscribed(self, channel: str) -> bool:
        return all(channel in listener.confirmed for listener in self.listeners)

    def _no_quorum(self, what: str, ok: int, failures: dict[str, str]) -> QuorumNotReached:
        return QuorumNotReached(
            f"{self.display}: {what} reached {ok} of {len(self.nodes)} nodes, "
            f"a quorum is {self.quorum}",
            failures,
        )

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        if not leases:
            return []
        packed = pack_script("extend", *extend_call(self.keys, leases))
        results = await self.fan.send("extend", packed, self._timeout(min(r.ttl for r in leases)))
        n = len(self.nodes)
        out: list[ExtendResult] = []
        failures = self.fan.failures(results)
        for j in range(len(leases)):
            ok = refused = 0
            for r in results.values():
                if isinstance(r, BaseException):
                    continue
                if int(r[j]) == 1:
                    ok += 1
                else:
                    refused += 1
            if ok >= self.quorum:
                out.append(True)
            elif refused > n - self.quorum:
                out.append(Refused(f"extended on {ok} of {n} nodes, refused on {refused}"))
            else:
                out.append(self._no_quorum("extend", ok, failures))
        return out

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        return await self._releases(name, owner, token)

    async def validate(self, name: str, token: int) -> bool:
        results = await self.fan.send("get", pack(b"GET", self.keys(name).lock), self.node_timeout)
        suffix = b":%d" % token
        agree = sum(
            1
            for r in results.values()
            if isinstance(r, bytes) and r.endswith(suffix) and not r.startswith(b"~")
        )
        if agree >= self.quorum:
            return True
        answered = sum(1 for r in results.values() if not isinstance(r, BaseException))
        if answered >= self.quorum:
            return False
        raise self._no_quorum(f"validate of {name!r}", answered, self.fan.failures(results))

    # -- waking ----------------------------------------------------------------------------

    async def _subscribe(self, channel: str) -> None:
        async with anyio.create_task_group() as tg:
            for listener in self.listeners:
                if channel not in listener.confirmed:
                    tg.start_soon(listener.subscribe, channel, self.node_timeout)

    async def _unsubscribe(self, channel: str) -> None:
        for listener in self.listeners:
            await listener.unsubscribe(channel)

    def _on_message(self, channel: str, payload: bytes) -> None:
        name = self._channels.get(channel)
        if name is None:
            return
        if payload[:1] == b"-" and payload[1:].decode(errors="replace") in self._attempting:
            return  # our own attempt giving back what it got: nothing was freed for us
        self._heard_from(name)

    def _on_reset(self) -> None:
        """A node's pub/sub connection dropped: its waiters are woken when it is back."""

    def _on_resumed(self) -> None:
        """A node is subscribed again after a drop: a release it published meanwhile was
        missed, so every waiter tries again now."""
        for name in list(self._watchers):
            self._heard_from(name)

    # -- who holds it, breaking a lock ------------------------------------------------------

    async def names(self) -> list[str]:
        raise NotImplementedError(
            f"{self.display} cannot list lock names: each name's keys live on every node "
            "and no one node's list is the lock's state; ask holder(NAME) for a name"
        )

    async def holder(self, name: str) -> Holder | None:
        packed = pack_script("holder", (self.keys(name).lock, self.keys.epoch), ())
        results = await self.fan.send("holder", packed, self.node_timeout)
        answered = 0
        by_owner: dict[str | None, list[Holder]] = {}
        graces: list[Holder] = []
        for r in results.values():
            if isinstance(r, BaseException):
                continue
            answered += 1
            one = holder_from_reply(name, r)
            if one is not None and one.grace_until is not None:
                graces.append(one)
            elif one is not None:
                by_owner.setdefault(one.owner, []).append(one)
        for owner, views in by_owner.items():
            if len(views) >= self.quorum:
                # Held while a quorum of nodes keeps the key: until the quorum-th longest
                # remaining time among them runs out (None: a node keeps no expiry).
                left = sorted((v.remaining for v in views if v.remaining is not None), reverse=True)
                remaining = left[self.quorum - 1] if len(left) >= self.quorum else None
                tokens = [v.token for v in views if v.token is not None]
                return Holder(name, owner, max(tokens) if tokens else None, remaining)
        free = answered - len(graces) - sum(len(views) for views in by_owner.values())
        if graces and free < self.quorum <= free + len(graces):
            # Free but for nodes in their restart grace: until enough of them end it.
            graces.sort(key=lambda v: v.remaining or 0.0)
            return graces[self.quorum - free - 1]
        if answered >= self.quorum:
            return None
        raise self._no_quorum(f"holder of {name!r}", answered, self.fan.failures(results))

    async def break_lock(self, name: str) -> bool:
        k = self.keys(name)
        packed = pack_script("break", k.release_keys, (k.channel,))
        results = await self.fan.send("break", packed, self.node_timeout)
        answered, removed = tally(results)
        if answered < self.quorum:
            # Some nodes may still carry the lease: the holder could keep a quorum.
            raise self._no_quorum(f"break_lock of {name!r}", answered, self.fan.failures(results))
        return removed > 0

    def _connected(self, node: Node) -> Callable[[str | None, bool], None]:
        def on_connect(run_id: str | None, reconnected: bool) -> None:
            # A node that restarted (a new run_id, or a reconnect: it may have) lost its keys
            # unless it persists them: renew now, so a lease that lost its quorum is lost
            # within one round trip, not at the next heartbeat.
            before, node.run_id = node.run_id, run_id or node.run_id
            if reconnected or node.run_id != before:
                self._renew_now()

        return on_connect

    # -- idempotency records: refused (see NO_RECORDS) ---------------------------------------

    async def record_get(self, name: str) -> Record | None:
        raise NotImplementedError(NO_RECORDS)

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        raise NotImplementedError(NO_RECORDS)

    async def record_delete(self, name: str, token: int) -> bool:
        raise NotImplementedError(NO_RECORDS)

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        raise NotImplementedError(
            f"semaphores are not on {self.display} yet, and cannot be run as on one server: "
            "each node picks its own free slot, so a majority of 'granted' answers need not "
            "agree on one slot, and a permit counted per node is not a permit across nodes. "
            "A quorum-safe grant is one Redlock per slot, tried slot by slot (up to `limit` "
            "rounds to every node per grant), with a majority-maximum token per slot; it is "
            f"not built. {SEMAPHORES_ELSEWHERE}"
        )

    def rwlock_store(self, name: str) -> RWStore:
        raise NotImplementedError(
            f"read-write locks are not on {self.display} yet: each node keeps its own "
            "readers, writer and waiting writers, so a read or write hold needs a grant "
            "on a majority (whose refusals must meet the other mode's majority), an epoch "
            "raised to the majority's maximum (as Redlock's fencing tokens) and intents "
            f"kept on a majority; that is not built. {RWLOCKS_ELSEWHERE}"
        )


def driver_from_url(url: str, **options: Any) -> RedlockDriver:
    nodes, display, from_url = parse_url(url)
    options = read_redlock_options({**from_url, **options})
    return RedlockDriver(nodes, display=display, **options)


__all__ = ("RedlockDriver", "driver_from_url")
