"""An etcd waiter watches only its predecessor's key (FIFO, no thundering herd).

What to watch travels in the failed attempt's ``Busy.cursor`` (a :class:`Predecessor`):
the core passes it to :meth:`Watching.watch`, and again whenever a later attempt finds a
different predecessor. The one watch a name has lives on its slot, so it ends with the
slot's wait (granted, dropped or freed), whichever task's ``unwatch`` comes first.
"""

from __future__ import annotations

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

        def on_event(kind: str, revision: int, key: bytes) -> None:
            if kind == "created":
                return
            if kind == "canceled" and slot.watch is not None and slot.watch[2] == watch_id:
                slot.watch = None  # compacted history: the next attempt's cursor is newer
            self._wake(name, slot.owner)  # only the slot's owner watches it (see _free)

        watch_id = self.client.watch(key, start, on_event)
        slot.watch = (key, start, watch_id)

    def _unwatch_slot(self, slot: _Slot) -> None:
        if slot.watch is not None:
            self.client.cancel_watch(slot.watch[2])
            slot.watch = None

    def _waits_reset(self) -> None:
        """The watch stream broke and the server forgot its watches: start each again
        from where it started (etcd replays what happened since; compacted: cancelled)."""
        for name, slot in self.slots.items():
            if slot.watch is not None:
                key, start, _ = slot.watch
                slot.watch = None
                self._watch_key(name, slot, key, start)
