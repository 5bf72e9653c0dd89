"""The etcd driver's watches, all on the client's one watch stream.

* **A waiter watches only its predecessor's key** (FIFO, no thundering herd). What to watch
  travels in the failed attempt's ``Busy.cursor`` (a :class:`Predecessor`): the core passes
  it to :meth:`Watching.watch`, and again whenever a later attempt finds a different
  predecessor. The one watch a name has lives on its slot, so it ends with the slot's wait
  (granted, dropped or freed), whichever task's ``unwatch`` comes first.
* **A holder watches its own key for deletion** (its *guard*), from a revision at which
  the key was seen: a key deleted behind our back (``asynclock break``, ``etcdctl del``) is
  seen when its event arrives, and the renewal round that follows refuses it. A renewal
  then costs a keep-alive and one progress request whatever the number held, instead of a
  listing of every key of the session (issue 45). Where a guard may have missed an event
  (its watch started again after compacted history, or could not be made), the session's
  keys are listed instead, once or for as long as a guard is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ._session import Predecessor

if TYPE_CHECKING:
    from ._session import _Slot
    from .client import EtcdClient


class Watching:
    """The watch half of :class:`~asynclock.backends.etcd.EtcdDriver` (a mixin over its
    state)."""

    client: EtcdClient
    slots: dict[str, _Slot]
    _renew_now: Callable[[], None]

    if TYPE_CHECKING:

        def _wake(self, name: str, owner: str | None = None, /) -> None: ...

    async def watch(self, name: str, cursor: object = None) -> bool:
        slot = self.slots.get(name)
        # No cursor: a task queued behind another task of this process (woken when the
        # slot is freed). A cursor of an earlier slot owner is stale: ignore it.
        if isinstance(cursor, Predecessor) and slot is not None and slot.owner == cursor.owner:
            self._watch_key(name, slot, cursor.key, cursor.revision + 1)
        # The watch starts just after the revision the attempt read: nothing is missed.
        return False

    async def unwatch(self, name: str) -> None:
        """Nothing: a local task queued behind the slot's owner has no watch of its own,
        and the owner's ends when its slot stops waiting."""

    def _watch_key(self, name: str, slot: _Slot, key: bytes, start: int) -> None:
        if slot.held:
            return
        if slot.watch is not None:
            if slot.watch[0] == key:
                return
            self._unwatch_slot(slot)

        def on_event(kind: str, revision: int) -> None:
            if kind == "canceled" and slot.watch is not None and slot.watch[2] == watch_id:
                slot.watch = None  # compacted history: the next attempt's cursor is newer
            self._wake(name)

        watch_id = self.client.watch(key, start, on_event)
        slot.watch = (key, start, watch_id)

    def _unwatch_slot(self, slot: _Slot) -> None:
        if slot.watch is not None:
            self.client.cancel_watch(slot.watch[2])
            slot.watch = None

    def _guard(self, slot: _Slot, start: int | None = None) -> None:
        """Watch our held key for its deletion from ``start`` (default: just after the
        revision it was last seen at, so nothing in between is missed)."""
        self._unguard(slot)

        def on_event(kind: str, revision: int) -> None:
            if self.slots.get(slot.name) is not slot or slot.guard != watch_id:
                return
            if kind == "deleted":
                # The next round refuses it, or finds the session's lease gone if that is
                # why (an expired or revoked lease deletes its keys too): the loss says why.
                slot.gone = True
                self._renew_now()
                return
            slot.guard = None  # the server dropped the watch
            if slot.session is not None:
                slot.session.recheck = True  # events before ``revision`` may be gone
            if revision > 0:  # compacted history: watch on from the oldest revision kept
                self._guard(slot, revision)

        watch_id = self.client.watch(
            slot.key, slot.seen_at + 1 if start is None else start, on_event
        )
        slot.guard = watch_id

    def _unguard(self, slot: _Slot) -> None:
        if slot.guard is not None:
            self.client.cancel_watch(slot.guard)
            slot.guard = None

    def _watches_reset(self) -> None:
        """The watch stream broke and the server forgot its watches: start each again
        from where it started (etcd replays what happened since; compacted: cancelled).
        The sessions of held keys are also listed once: the outage is checked at once,
        not when the replayed history has caught up."""
        for name, slot in self.slots.items():
            if slot.watch is not None:
                key, start, _ = slot.watch
                slot.watch = None
                self._watch_key(name, slot, key, start)
            if slot.guard is not None:
                slot.guard = None
                self._guard(slot)
                if slot.session is not None:
                    slot.session.recheck = True
