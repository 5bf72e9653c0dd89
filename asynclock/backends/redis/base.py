"""The driver base both Redis drivers extend: pub/sub waiting per name (one channel each,
kept a while after its last waiter), what a Busy answer's cursor tells ``watch``, and the
answer for a database in its restart grace."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..._core.driver import Busy, Driver
from .._common.asyncio_only import require_asyncio
from .keys import KeyCache
from .scripts import MAX_IDLE_SUBSCRIPTIONS

logger = logging.getLogger("asynclock.redis")


@dataclass(frozen=True, slots=True, eq=False)
class Heard:
    """The :attr:`~asynclock._core.driver.Busy.cursor` of every Redis busy answer.

    ``quiet``: the backend was subscribed to the name's channel before it asked, still is,
    and no wake-up for the name came in while it asked, so a release after the attempt
    will reach it as a message: ``watch`` has missed nothing and subscribes no more.
    A Redis watch never moves (one channel per name), so every ``Heard`` equals every
    other: the core calls ``watch`` once per wait, with the first answer's verdict.
    """

    quiet: bool

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Heard)

    def __hash__(self) -> int:
        return hash(Heard)


QUIET, LOUD = Heard(True), Heard(False)

#: The answer for a lock key without an expiry (PTTL -1): asynclock's keys always have one.
NO_EXPIRY = Busy(
    None,
    "its Redis key has no expiry (PTTL -1: set by another tool, or a legacy lock), so when "
    "it frees is unknown; waiters poll for it",
    cursor=LOUD,
)


class GraceReport:
    """Busy answers for a database in its restart grace (see ``grace_left``), and one
    WARNING per grace (per end time) for the driver's life."""

    def __init__(self, display: str) -> None:
        self.display = display
        self._warned: OrderedDict[int, None] = OrderedDict()

    def busy(self, left_ms: int, end_ms: int, cursor: Heard = LOUD) -> Busy:
        until = end_ms / 1000
        if end_ms not in self._warned:
            self._warned[end_ms] = None
            if len(self._warned) > 64:  # a Redlock's nodes each have their own
                self._warned.popitem(last=False)
            logger.warning(
                "%s: restart grace until %s UTC (%.1fs from now): the database lost its lock "
                "data or never had any (a new database, a flush, a restart without "
                "persistence, or a failover to a replica that may lack the last grants), so "
                "no lock is granted before then: a lease granted before the loss may still "
                "be running. The option restart_grace (seconds; 0 turns it off) sets how long "
                "it lasts after the server starts (or the failover is seen).",
                self.display,
                time.strftime("%H:%M:%S", time.gmtime(until)),
                left_ms / 1000,
            )
        return Busy(
            left_ms / 1000,
            f"{self.display} lost its lock data or never had any (a new database, a flush, "
            "a restart without persistence, or a failover), and a lease granted before may "
            "still be running",
            cursor=cursor,
            grace_until=until,
        )


class SubscribingDriver(Driver):
    """Pub/sub bookkeeping shared by the Redis and Redlock drivers.

    One subscription per watched name, kept for a while after its last waiter leaves (a
    name locked again soon needs no new SUBSCRIBE). Subclasses subscribe and unsubscribe
    a channel on their node(s).
    """

    remote = True  # every acquire and release is a server round trip

    def __init__(self, prefix: str) -> None:
        super().__init__()
        require_asyncio("the Redis backend (redis://, redlock://)", "redis-py's asyncio client")
        self.keys = KeyCache(prefix)
        self._channels: dict[str, str] = {}  # channel -> name
        self._watchers: dict[str, int] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()
        #: Wake-ups delivered per subscribed name (messages and resets).
        self._heard: dict[str, int] = {}
        self._open = False

    async def _subscribe(self, channel: str) -> None:
        raise NotImplementedError

    async def _unsubscribe(self, channel: str) -> None:
        raise NotImplementedError

    async def watch(self, name: str, cursor: object = None) -> bool:
        quiet = isinstance(cursor, Heard) and cursor.quiet
        if not self._open:
            return False
        channel = self.keys(name).channel_name
        self._channels[channel] = name
        self._heard.setdefault(name, 0)
        self._watchers[name] = self._watchers.get(name, 0) + 1
        self._idle.pop(name, None)
        if quiet:
            return False
        await self._subscribe(channel)
        return True

    async def unwatch(self, name: str) -> None:
        count = self._watchers.get(name, 0) - 1
        if count > 0:
            self._watchers[name] = count
            return
        self._watchers.pop(name, None)
        self._idle[name] = None
        while len(self._idle) > MAX_IDLE_SUBSCRIPTIONS:
            old, _ = self._idle.popitem(last=False)
            channel = self.keys(old).channel_name
            self._channels.pop(channel, None)
            self._heard.pop(old, None)
            await self._unsubscribe(channel)

    def _heard_from(self, name: str, owner: str | None = None) -> None:
        """A release of ``name`` was heard (with ``owner``: handed to that local waiter,
        the only one woken)."""
        self._heard[name] = self._heard.get(name, 0) + 1
        self._wake(name, owner)
