"""``redis://`` — one Redis (or Valkey) server; also ``rediss://`` (TLS) and ``unix://``.

* Acquire is one round trip: a Lua script sets the lock key and bumps the name's fence
  counter, both in one hash slot (``asynclock:{name}`` and ``asynclock:{name}:fence``), so
  Redis Cluster keeps them together. A missing counter is seeded from the server's ``TIME``
  (ms * 1000) so tokens keep rising after a restart that lost data (G2).
* Waiters queue first come, first served in a sorted set next to the lock. A release hands
  the name to the oldest live waiter with a short reservation and publishes that waiter's id
  on the name's channel, so only that waiter wakes (no herd, no barging). Queue entries
  expire, so a waiter that died can delay the name by at most about one ttl, like a holder
  that died.
* The renewer's batch of leases is extended in one Lua call; each lease gets its own answer.
* One pub/sub connection per driver carries every watched name.

URL: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` for TLS,
``unix:///path/to/redis.sock?db=0``; query options as in redis-py (``ssl_ca_certs``, …).
Driver options (keyword arguments to :func:`asynclock.connect`): ``socket_timeout`` (per
call, seconds, default 1.0 — keep it small relative to your ttls), ``connect_timeout``
(default 1.0), ``prefix`` (key prefix, default ``"asynclock:"``), ``fair`` (FIFO waiter
queue, default True), ``restart_grace`` (seconds after the server's start with no grant
when the database lost its data, default the first ttl asked for; also a URL query option);
anything else goes to
``redis.asyncio.ConnectionPool.from_url``.

* A restart is noticed on the pub/sub connection (kept open while a lease is held): a new
  ``run_id`` loses every lease the server granted before, and any reconnect asks the core
  for a renewal round at once. A missing epoch key (fresh or lost data) starts the restart
  grace (see ``grace_left``): busy answers with ``Busy.grace_until``, one WARNING per grace.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._core.driver import Busy, ExtendResult, LeaseRef, Record, Refused
from ..._core.holder import Holder
from ..._core.permit_store import PermitStore
from ..._core.rw_store import RWStore
from .._common.asyncio_only import require_asyncio
from .._common.options import check_restart_grace
from .base import LOUD, NO_EXPIRY, QUIET, GraceReport, SubscribingDriver
from .blocking import BlockingCalls
from .keys import glob_escape, name_of_key, record_key, scope_fence_key
from .options import NodeURL, read_redis_url
from .pubsub import Listener
from .replies import extend_call, extend_result, grace_ms, holder_from_reply, token_of
from .rwlock import RedisRW
from .scripts import JOIN_QUEUE, NO_QUEUE, RESPECT_QUEUE
from .semaphore import RedisPermits
from .wire import Node, ms, pack


@dataclass(slots=True, eq=False)
class _Wait:
    """A local waiter of the fair queue, and the last answer the server gave it."""

    member: str
    #: Bumped when a message may concern this waiter (it was handed the name, or a broadcast).
    bumps: int = 0
    #: An attempt was sent, so the server may have queued it: leaving must tell it.
    joined: bool = False
    #: A Busy answer stays true until this clock time, unless ``bumps`` moves.
    valid_until: float = -math.inf
    valid_bumps: int = -1
    #: That answer's ``Busy.grace_until`` (and detail): a restart grace, not a holder.
    valid_grace: Busy | None = None


class RedisDriver(SubscribingDriver):
    """Locks on one Redis server (see the module docstring)."""

    def __init__(
        self,
        url: str | NodeURL,
        *,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        prefix: str = "asynclock:",
        fair: bool = True,
        restart_grace: float | None = None,
        **redis_options: Any,
    ) -> None:
        super().__init__(prefix)
        self.restart_grace = check_restart_grace(restart_grace)
        self.node = Node(
            url if isinstance(url, NodeURL) else NodeURL.of(url),
            socket_timeout=socket_timeout,
            connect_timeout=connect_timeout,
            options=redis_options,
        )
        self.display = self.node.display
        self.grace = GraceReport(self.display)
        self.prefix = prefix
        self.fair = fair
        # With the fair queue, a release hands the name to the queue's head and publishes
        # its owner: the listener wakes only that waiter (the core need not wake them all).
        self.wakes_waiters = fair
        self.listener = Listener(
            self.node, self._on_message, self._on_reset, self._on_resumed, self._on_connect
        )
        self._waits: dict[str, dict[str, _Wait]] = {}
        #: Leases granted here and not yet released: owner -> (name, drops seen at grant).
        self._leases: dict[str, tuple[str, int]] = {}
        self.keys.held = self._leases.__len__
        self._drops = 0
        #: Set when a restart was seen, until the next renewal round has said so.
        self._restart_note: str | None = None
        #: This backend's probe channel (see the Lua notes): a queue entry naming it is
        #: skipped at once when this backend's connection is gone.
        self._probe = secrets.token_hex(8)
        self._probe_channel = f"{prefix}w:{self._probe}"
        self._blocking = BlockingCalls(self)

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        require_asyncio(self.display, "redis-py's asyncio client")
        await self.node.load()
        self._open = True

    async def background(self) -> None:
        await self.listener.run()

    async def aclose(self) -> None:
        self._open = False
        self._blocking.close()
        await self.node.aclose()

    # -- primitives ------------------------------------------------------------------------

    async def acquire(
        self, name: str, owner: str, ttl: float, *, queue: bool, scope: str | None = None
    ) -> int | Busy:
        k = self.keys(name)
        ttl_ms = ms(ttl)
        mode = (JOIN_QUEUE if queue else RESPECT_QUEUE) if self.fair else NO_QUEUE
        wait: _Wait | None = None
        if mode == JOIN_QUEUE:
            waits = self._waits.setdefault(name, {})
            wait = waits.get(owner)
            now = self.clock.now()
            if wait is None:
                wait = waits[owner] = _Wait(f"{owner}:{ttl_ms}")
            if self._probe_channel in self.listener.confirmed:
                wait.member = f"{owner}:{ttl_ms}:{self._probe}"
            if wait.valid_bumps == wait.bumps and now < wait.valid_until:
                # Nothing that concerns us was published since the server said "busy"
                # (and we were subscribed before asking): that answer still holds.
                grace = wait.valid_grace
                if grace is not None:
                    return Busy(
                        wait.valid_until - now,
                        grace.detail,
                        cursor=QUIET,
                        grace_until=grace.grace_until,
                    )
                return Busy(wait.valid_until - now, cursor=QUIET)
        listener = self.listener
        trusted = k.channel_name in listener.confirmed
        epoch = listener.epoch
        heard = self._heard.get(name, 0)
        bumps = wait.bumps if wait is not None else 0
        t_send = self.clock.now()
        probe = b""
        if wait is not None:
            # From the moment the script is sent the server may queue us, whether or not
            # its answer arrives (a waiter cancelled meanwhile must still leave the queue).
            wait.joined = True
            if wait.member.count(":") == 2:
                probe = self._probe.encode()
        keys: tuple[bytes, ...] = k.acquire_keys
        if scope is not None:
            keys = (*keys, scope_fence_key(scope, self.keys.prefix))
        reply = await self.node.run(
            "acquire",
            keys,
            (
                owner.encode(),
                b"%d" % ttl_ms,
                mode,
                k.channel,
                grace_ms(self.restart_grace, ttl_ms),
                probe,
            ),
        )
        if reply[0]:
            if wait is not None:
                self._forget_wait(name, owner)
            self._leases[owner] = (name, self._drops)
            if self.fair:
                listener.wanted.add(self._probe_channel)  # subscribed when it connects
            listener.keep_connected()
            return int(reply[0])
        if int(reply[1]) == -1:
            # No expiry: when it frees is unknown. The core polls (and a release through
            # asynclock would still wake us); no valid_until, so no cached "busy" either.
            return NO_EXPIRY
        retry = int(reply[1]) / 1000
        # Subscribed before we asked, still subscribed, and no wake-up for this name came
        # in while we asked: any release after our attempt will reach us as a message.
        quiet = (
            trusted
            and listener.epoch == epoch
            and k.channel_name in listener.confirmed
            and self._heard.get(name, 0) == heard
        )
        cursor = QUIET if quiet else LOUD
        busy = self.grace.busy(int(reply[1]), int(reply[2]), cursor) if len(reply) > 2 else None
        if wait is not None and quiet:
            wait.valid_until = t_send + retry
            wait.valid_bumps = bumps
            wait.valid_grace = busy
        return busy or Busy(retry, cursor=cursor)

    async def extend(self, leases: Sequence[LeaseRef]) -> Sequence[ExtendResult]:
        if not leases:
            return []
        # (A call carries any subset of the held leases: ``_leases`` loses an entry only
        # when its lease is released, here or by the GC's reaping release.)
        keys, args = extend_call(self.keys, leases)
        note, self._restart_note = self._restart_note, None
        reply = await self.node.run("extend", keys, args)
        results = [extend_result(int(code)) for code in reply]
        if note is None and any(isinstance(r, Refused) for r in results):
            # Keys gone: if the server restarted and the pub/sub reconnect has not said so
            # yet (it may come after this round), say it here, from the server's run_id.
            note = await self._restarted_since()
        if note is None:
            return results
        return [Refused(f"{r.reason}: {note}") if isinstance(r, Refused) else r for r in results]

    async def _restarted_since(self) -> str | None:
        """The restart note ("the Redis server restarted (…)") if the server's ``run_id`` is
        not the one last seen, else None."""
        before = self.node.run_id
        if before is None:
            return None
        try:
            now = await self.node.read_run_id(self.node.deadline())
        except Exception:  # the refusal stands as it is; the reconnect will tell
            return None
        if now is None or now == before:
            return None
        return f"the Redis server restarted (run_id {before} is now {now})"

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        k = self.keys(name)
        self._leases.pop(owner, None)
        reply = await self.node.run(
            "release",
            k.release_keys,
            (owner.encode(), b"" if token is None else b"%d" % token, k.channel),
        )
        return bool(reply)

    def semaphore_store(self, name: str, limit: int) -> PermitStore:
        if type(self) is not RedisDriver:  # a primary of sentinel/cluster: see routed_holds
            return super().semaphore_store(name, limit)
        return RedisPermits(self, name, limit)

    def rwlock_store(self, name: str) -> RWStore:
        if type(self) is not RedisDriver:  # a primary of sentinel/cluster: see routed_holds
            return super().rwlock_store(name)
        return RedisRW(self, name)

    async def validate(self, name: str, token: int) -> bool:
        value = await self.node.get(self.keys(name).lock)
        return value is not None and token_of(value) == token

    async def abandon(self, name: str, owner: str) -> None:
        wait = self._forget_wait(name, owner)
        if wait is None or not wait.joined:
            return
        k = self.keys(name)
        await self.node.run(
            "abandon", k.release_keys, (wait.member.encode(), owner.encode(), k.channel)
        )

    # -- calls from other threads (asynclock.from_thread) -----------------------------------

    def thread_calls(self) -> BlockingCalls:
        return self._blocking

    def adopted(self, name: str, owner: str) -> None:
        # What acquire() keeps for a grant.
        self._leases[owner] = (name, self._drops)
        if self.fair:
            self.listener.wanted.add(self._probe_channel)
        self.listener.keep_connected()

    def forget(self, owner: str) -> None:
        self._leases.pop(owner, None)

    # -- waking ----------------------------------------------------------------------------

    async def _subscribe(self, channel: str) -> None:
        listener = self.listener
        if self.fair and self._probe_channel not in listener.confirmed:
            await listener.subscribe(self._probe_channel, self.node.socket_timeout)
        await listener.subscribe(channel, self.node.socket_timeout)

    async def _unsubscribe(self, channel: str) -> None:
        await self.listener.unsubscribe(channel)

    def _on_message(self, channel: str, payload: bytes) -> None:
        name = self._channels.get(channel)
        if name is None:
            return
        waits = self._waits.get(name)
        if payload:
            # The name was handed to one waiter: wake only it, if it is ours.
            owner = payload.decode()
            wait = waits.get(owner) if waits else None
            if wait is None:
                return
            wait.bumps += 1
            self._heard_from(name, owner)
            return
        if waits:
            for wait in waits.values():
                wait.bumps += 1
        self._heard_from(name)

    def _on_reset(self) -> None:
        """The pub/sub connection dropped: a release may go unheard, so no cached busy
        answer stands (the waiters are woken when the connection is back)."""
        self._drops += 1
        self._bump_waits()

    def _on_resumed(self) -> None:
        """Subscribed again after a drop: a release published meanwhile was missed, so
        every waiter asks the server again now."""
        self._bump_waits()
        for name in {*self._waits, *self._watchers}:
            self._heard_from(name)

    def _bump_waits(self) -> None:
        for waits in self._waits.values():
            for wait in waits.values():
                wait.bumps += 1

    def _on_connect(self, run_id: str | None, reconnected: bool) -> None:
        """Connected (again). A new ``run_id`` on a reconnect means the server restarted
        while we were connected: every lease it granted before the drop is gone (loss
        within one round trip of the reconnect, not at the next renewal). On a first
        connection a new ``run_id`` says the server restarted since the backend opened, but
        not which leases came from before: the renewal round asked for here tells, lease
        by lease (a lease the restarted server granted is kept). Any reconnect, and any
        new ``run_id``, asks for that round now."""
        before, self.node.run_id = self.node.run_id, run_id or self.node.run_id
        restarted = before is not None and run_id is not None and run_id != before
        if restarted:
            # Said with the refusals of the round below: why the keys are gone.
            self._restart_note = f"the Redis server restarted (run_id {before} is now {run_id})"
        if restarted and reconnected:
            why = f"{self._restart_note}; the leases it granted are gone"
            drops = self._drops
            for owner, (name, seen) in list(self._leases.items()):
                if seen < drops:
                    del self._leases[owner]
                    self._notify_lost(name, owner, why)
        if reconnected or restarted:
            self._renew_now()

    def _forget_wait(self, name: str, owner: str) -> _Wait | None:
        waits = self._waits.get(name)
        if waits is None:
            return None
        wait = waits.pop(owner, None)
        if not waits:
            del self._waits[name]
        return wait

    # -- idempotency records: a key beside the lock key, expiring after keep --------------

    async def record_get(self, name: str) -> Record | None:
        value = await self.node.get(record_key(name, self.prefix))
        if value is None:
            return None
        token, _, payload = value.partition(b"\n")
        return Record(int(token), payload.decode())

    async def record_put(
        self, name: str, owner: str, token: int, payload: str, keep: float
    ) -> bool:
        keys = (self.keys(name).lock, record_key(name, self.prefix))
        args = (owner.encode(), b"%d" % token, payload.encode(), b"%d" % ms(keep))
        return bool(await self.node.run("record_put", keys, args))

    async def record_delete(self, name: str, token: int) -> bool:
        keys = (record_key(name, self.prefix),)
        return bool(await self.node.run("record_delete", keys, (b"%d" % token,)))

    # -- who holds it, breaking a lock ------------------------------------------------------

    async def names(self) -> list[str]:
        return await self._scan(self.prefix, "listing names")  # lock keys: <prefix>{<name>}

    async def hold_names(self) -> tuple[list[str], list[str]]:
        # A semaphore's sorted set of live permits, <prefix>sem:{<name>} (gone with its
        # last permit), and a read-write lock's hash, <prefix>rw:{<name>} (kept: its epoch).
        what = "listing semaphores and rwlocks"
        return await self._scan(self.prefix + "sem:", what), await self._scan(
            self.prefix + "rw:", what
        )

    async def _scan(self, prefix: str, what: str) -> list[str]:
        """The names of every key ``<prefix>{<name>}`` (SCAN, 1000 at a time)."""
        node = self.node
        deadline = node.deadline(10 * node.socket_timeout)
        match = f"{glob_escape(prefix)}{{*}}".encode()
        found: list[str] = []
        cursor = b"0"
        try:
            while True:
                packed = pack(b"SCAN", cursor, b"MATCH", match, b"COUNT", b"1000")
                cursor, keys = await node.call(packed, deadline)
                found += [name for key in keys if (name := name_of_key(key, prefix))]
                if cursor in (b"0", 0):
                    return found
        except Exception as exc:
            raise node.error(f"{what} failed", exc) from exc

    async def holder(self, name: str) -> Holder | None:
        k = self.keys(name)
        reply = await self.node.run("holder", (k.lock, self.keys.epoch), ())
        return holder_from_reply(name, reply)

    async def break_lock(self, name: str) -> bool:
        k = self.keys(name)
        return bool(await self.node.run("break", k.release_keys, (k.channel,)))


def driver_from_url(url: str, **options: Any) -> RedisDriver:
    node, ours = read_redis_url(url, options)
    return RedisDriver(node, **ours)


__all__ = ("RedisDriver", "driver_from_url")
