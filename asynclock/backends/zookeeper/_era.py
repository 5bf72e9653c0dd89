"""The wipe marker: a ZooKeeper ensemble that lost its data (a data directory wiped, or
restored from an older copy) is seen by every client, its tokens stay above the old
ones, and nothing is granted while a holder from before the loss may still run.

ZooKeeper numbers transactions (``zxid``) from where its data directory says: a wiped
ensemble counts again from near 0, so a node's ``czxid`` alone would hand out tokens below
the ones granted before the wipe (a fence would then refuse the new holder and accept the
old one), and a new client, seeing no node, would be granted a name a holder from before
the loss still believes it holds.

* **Marker.** One persistent node, :data:`MARKER` at the chroot's root: a segment no
  lock, semaphore, read-write lock or partition name maps to (the encoding writes
  ``%2E`` only as a whole segment ``.``, see :mod:`._paths`), under asynclock's reserved
  prefix, so the listing of names skips it. Created if absent (two clients racing: the
  loser reads the winner's). Its stat gives ``ctime`` (the server's clock, ms) and
  ``czxid``.
* **Token** = ``ctime_ms * 1000 + (czxid - the marker's czxid)`` (:meth:`Era.token`, the one
  place a czxid or an epoch's mzxid becomes a token; delete guards compare raw czxids): the
  Redis backend's seed (``TIME`` ms * 1000) with ZooKeeper's order on top. A later marker
  has a later ctime, so the new era's tokens are above the old era's as long as the ms
  between the two markers times 1,000 exceed the old era's czxid growth (each leader
  election adds 2**32: see docs/backends/zookeeper.md for the figures). Below 2**53 (Lua
  fences compare doubles) until the year 2255 less 71.6 minutes per election.
* **Detection.** The marker is read on every session the driver opens (and at connect); a
  marker of another czxid or ctime than the one seen before (a wiped server that creates it
  as its first transaction gives it the same czxid again) means the data was lost: every
  lease of this backend is lost at once, with a reason that says so.
* **Restart grace.** No grant until ``restart_grace`` seconds (default: the first ttl this
  backend asks for; 0: none) after the marker's ctime, as the Redis backend after a
  restart that lost its data: a holder from before the loss runs at most its ttl past its
  last renewal, which was before the loss. A fresh ensemble waits it once, as a fresh Redis
  does. The server's clock, not ours: each read writes the marker (its data unchanged), so
  the answer's ``mtime`` is the server's now. Data ``0`` in the marker (an operator's, or a
  test harness's "in service for long", as Redis's epoch key ``0``) means no grace is due.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import anyio

from ..._core.driver import Busy
from ..._core.exceptions import BackendUnavailable
from ._kazoo import BadVersionError, NodeExistsError, NoNodeError, Stat
from ._nodes import DRIFT
from ._paths import RESERVED

if TYPE_CHECKING:
    from .driver import ZooKeeperDriver

logger = logging.getLogger("asynclock.zookeeper")

#: The wipe marker's path (relative to the chroot): ``/%00asynclock.%2Ewipe``.
MARKER = f"/{RESERVED}%2Ewipe"
#: The marker's data that says no restart grace is due (a server in service for long).
SETTLED = b"0"


@dataclass(frozen=True, slots=True)
class Era:
    """The marker as read on one session: where this era's tokens start."""

    czxid: int
    ctime_ms: int
    #: The session it was read on (a new session reads it again).
    session: int | None
    #: No grace is due (the marker's data is :data:`SETTLED`).
    settled: bool
    #: The server's now minus ``ctime_ms`` when read, and our clock when the answer came.
    age_ms: int
    seen_at: float

    @property
    def identity(self) -> tuple[int, int]:
        """What tells two markers apart: a wiped ensemble that creates the marker as its
        first transaction gives it the same czxid again, never the same ctime."""
        return self.czxid, self.ctime_ms

    @property
    def base(self) -> int:
        """The era's first token (the marker's ctime in ms * 1000, as Redis seeds)."""
        return self.ctime_ms * 1000

    def token(self, zxid: int) -> int:
        """The token of the node created (or the epoch written) at transaction ``zxid``."""
        return self.base + (zxid - self.czxid)

    def zxid(self, token: int) -> int:
        """The transaction of a token of this era (the inverse of :meth:`token`)."""
        return token - self.base + self.czxid


class Eras:
    """The driver's marker: read it, see a new one, and the restart grace (see the module)."""

    def __init__(self, driver: ZooKeeperDriver, restart_grace: float | None) -> None:
        self.driver = driver
        self.restart_grace = restart_grace
        self.era: Era | None = None
        self._first_ttl: float | None = None
        self._reading = anyio.Lock()
        self._due = anyio.Event()
        self._warned: tuple[int, int] | None = None

    def token(self, zxid: int) -> int:
        assert self.era is not None  # read at open
        return self.era.token(zxid)

    def zxid(self, token: int) -> int:
        assert self.era is not None  # read at open
        return self.era.zxid(token)

    def holds(self, era: Era, session: int | None) -> bool:
        """``era`` is still the one in use, and ``session`` (a call's) its session."""
        return self.era is era and era.session == session == self.driver.zk.session_id

    async def current(self) -> Era:
        """The era of the session in use: read the marker again on a new session."""
        era = self.era
        session = self.driver.zk.session_id
        if era is not None and session is not None and era.session == session:
            return era
        async with self._reading:
            while True:
                era = self.era
                session = self.driver.zk.session_id
                if era is not None and session is not None and era.session == session:
                    return era
                new = await self._read()
                if new.session != self.driver.zk.session_id:
                    continue  # read on a session that ended meanwhile: again
                self.era = new
                if era is not None and new.identity != era.identity:
                    self._lost(era, new)
                return new

    async def _read(self) -> Era:
        call, zk = self.driver._call, self.driver.zk
        while True:
            session = zk.session_id
            stat: Stat
            try:
                data, stat = await call("reading the wipe marker", partial(zk.get, MARKER))
                if data != SETTLED:  # the server's now: rewrite it, data unchanged
                    stat = await call(
                        "reading the wipe marker", partial(zk.set_data, MARKER, data, stat.version)
                    )
            except BackendUnavailable as exc:
                if isinstance(exc.__cause__, BadVersionError):
                    # Written meanwhile (another client's read): its mtime is the server's
                    # now at a moment during ours, a little early, so the grace left is a
                    # little longer (safe), and a fleet reconnecting at once writes once
                    # each instead of retrying against one another.
                    data, stat = await call("reading the wipe marker", partial(zk.get, MARKER))
                elif not isinstance(exc.__cause__, NoNodeError):
                    raise
                else:
                    try:
                        data = b""
                        stat = await call(
                            "creating the wipe marker", partial(zk.create, MARKER, data)
                        )
                    except BackendUnavailable as again:
                        if isinstance(again.__cause__, NodeExistsError):
                            continue  # another client created it first: read theirs
                        raise
            now = self.driver.clock.now()
            return Era(
                stat.czxid,
                stat.ctime,
                session,
                data == SETTLED,
                max(0, stat.mtime - stat.ctime),
                now,
            )

    def _lost(self, old: Era, new: Era) -> None:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(new.ctime_ms / 1000))
        why = (
            "ZooKeeper lost its data (a data directory wiped, or restored from an older "
            f"copy): its wipe marker {MARKER} is a new one (created {created} UTC, czxid "
            f"{new.czxid:#x}; the one seen before: {old.ctime_ms} ms, {old.czxid:#x}), so "
            "every node of ours is gone"
        )
        logger.warning("%s: %s", self.driver.display, why)
        self.driver._data_lost(why)

    # -- the restart grace ------------------------------------------------------------------

    def grace(self, ttl: float) -> float:
        """The grace this backend applies: ``restart_grace``, else the first ttl asked for."""
        if self._first_ttl is None:
            self._first_ttl = ttl
        return self._first_ttl if self.restart_grace is None else self.restart_grace

    def busy(self, era: Era, ttl: float) -> Busy | None:
        """A Busy answer while ``era``'s restart grace runs (None: no grace is due)."""
        grace = self.grace(ttl)
        if era.settled or grace <= 0:
            return None
        # Counted on our clock from when the server's now was read, slowed by the drift
        # allowance, so that it never ends before the server's ctime + grace.
        left = era.seen_at + (grace - era.age_ms / 1000) * (1 + DRIFT) - self.driver.clock.now()
        if left <= 0:
            return None
        until = era.ctime_ms / 1000 + grace
        if self._warned != era.identity:
            self._warned = era.identity
            logger.warning(
                "%s: restart grace until %s UTC (%.1fs from now): the ZooKeeper data is new "
                "(its wipe marker %s was created %.1fs ago: a new ensemble, or one that lost "
                "its data), so no lock is granted before then: a lease granted before the "
                "loss may still be running. The option restart_grace (seconds; 0 turns it "
                "off) sets how long it lasts after the marker's creation.",
                self.driver.display,
                time.strftime("%H:%M:%S", time.gmtime(until)),
                left,
                MARKER,
                era.age_ms / 1000,
            )
        return Busy(
            left,
            f"{self.driver.display} has new data (a new ensemble, or one that lost its data), "
            "and a lease granted before may still be running",
            grace_until=until,
        )

    # -- a new session: read the marker at once -----------------------------------------------

    def session_opened(self) -> None:
        era = self.era
        if era is None or era.session != self.driver.zk.session_id:
            self._due.set()

    async def watch(self) -> None:
        """Read the marker on each new session, whether or not a call needs it (a loss is
        told as soon as it is seen)."""
        while True:
            await self._due.wait()
            self._due = anyio.Event()
            try:
                await self.current()
            except Exception as exc:  # the next call reads it again
                logger.debug("reading the wipe marker failed: %r", exc)


__all__ = ("MARKER", "SETTLED", "Era", "Eras")
