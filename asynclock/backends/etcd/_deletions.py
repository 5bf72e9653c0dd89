"""One watch for the deletion of any key under the driver's prefix, while many are held.

A held key can be deleted behind our back (``asynclock break``, ``etcdctl del``); a renewal
must then refuse it. Listing every key of a session each round (``LeaseTimeToLive`` with
keys) does that with a reply that grows with the number held. With many held, one watch
on the prefix (deletions only) does it instead, and a round costs a keep-alive and one
progress request whatever the number (issue 45):

* the watch starts at the server's current revision, so it never has history to catch up
  on (a watch that starts in the past makes etcd scan every revision since, in batches,
  blocking its writes meanwhile: measured, 10,000 acquisitions at once then failed). It is
  *live* from the revision carried by a keep-alive ack sent after the server confirmed it,
  and from then on sees every deletion at that revision or later;
* a deletion of a key we hold, after the revision at which we saw it, marks the key gone
  and asks for a renewal round, which refuses it (or finds its lease gone, if that is why:
  an expired or revoked lease deletes its keys too);
* where a deletion may have gone unseen (the watch not live yet, just live, restarted after
  the stream broke, or a key seen before its start), each session concerned is listed
  once (``Session.recheck``), and every round while the watch is not live.

With few held the listing is small, and a watch on the prefix would carry every deletion
under it (all of etcd's keys with the default empty prefix) to this process: below
:data:`WATCH_AT` held names there is no watch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .client import prefix_end

if TYPE_CHECKING:
    from .client import EtcdClient

logger = logging.getLogger("asynclock.etcd")

#: The watch runs while at least this many names are in use here (and stops below half).
WATCH_AT = 1000


class Deletions:
    """The deletions watch of one driver: ``on_deleted(key, revision)`` for each deletion
    under ``prefix``."""

    def __init__(
        self, client: EtcdClient, prefix: bytes, on_deleted: Callable[[bytes, int], None]
    ) -> None:
        self._client = client
        self._key = prefix or b"\0"  # the empty prefix: every key
        self._end = prefix_end(prefix)
        self._on_deleted = on_deleted
        self._id: int | None = None
        self._created = False
        #: Live: every deletion at this revision or later reaches ``on_deleted`` (0: not).
        self.since = 0
        #: The server refused the watch (no read permission on the prefix): lists only.
        self.refused = False

    def covers(self, revision: int) -> bool:
        """Does the watch see every deletion after ``revision``?"""
        return self.since > 0 and self.since <= revision + 1

    @property
    def confirmed(self) -> int | None:
        """The id of the watch if the server has confirmed it (read before a keep-alive is
        sent, for :meth:`went_live`)."""
        return self._id if self._created else None

    def went_live(self, confirmed: int | None, revision: int) -> bool:
        """A keep-alive sent when the watch was ``confirmed`` was acknowledged at
        ``revision``: the server had the watch then, so it sees every deletion from the
        next revision on. True if the watch has just become live (the keys seen before
        need one listing)."""
        if confirmed is None or confirmed != self._id or self.since:
            return False
        self.since = revision + 1
        return True

    def wanted(self, in_use: int) -> bool:
        """Is a watch (running, or to start now) worth it for ``in_use`` names?"""
        return self._id is not None or (in_use >= WATCH_AT and not self.refused)

    def fit(self, in_use: int) -> None:
        """Start the watch if ``in_use`` names are many, stop it if they are few."""
        if self._id is None and in_use >= WATCH_AT and not self.refused:
            self.start()
        elif self._id is not None and in_use < WATCH_AT // 2:
            self.stop()

    def start(self) -> None:
        self.stop()

        def on_event(kind: str, revision: int, key: bytes) -> None:
            if self._id != watch_id:
                return
            if kind == "deleted":
                self._on_deleted(key, revision)
            elif kind == "created":
                self._created = True
            else:  # refused (a watch from now has no history that could be compacted)
                self._id, self._created, self.since = None, False, 0
                self.refused = True
                logger.info(
                    "%s: the watch for deletions was refused; each renewal lists the keys "
                    "of its session instead",
                    self._client.errors.display,
                )

        # Start revision 0: from the server's current revision on, nothing to catch up.
        watch_id = self._client.watch(self._key, 0, on_event, range_end=self._end)
        self._id = watch_id

    def stop(self) -> None:
        if self._id is not None:
            self._client.cancel_watch(self._id)
        self._id, self._created, self.since = None, False, 0

    def reset(self) -> None:
        """The watch stream broke and the server forgot the watch: start it again (what
        happened in between: the listing once it is live)."""
        if self._id is not None:
            self._id = None
            self.start()
