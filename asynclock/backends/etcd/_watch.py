"""An etcd waiter watches only its predecessor's key (FIFO, no thundering herd)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._session import _Slot
    from .client import EtcdClient


class Watching:
    """The watch half of :class:`~asynclock.backends.etcd.EtcdDriver` (a mixin over its
    state)."""

    client: EtcdClient
    slots: dict[str, _Slot]
    _watched: dict[str, int]

    if TYPE_CHECKING:

        def _wake(self, name: str) -> None: ...

    async def watch(self, name: str) -> bool:
        self._watched[name] = self._watched.get(name, 0) + 1
        slot = self.slots.get(name)
        if slot is not None:
            self._watch_slot(name, slot)
        # Watches start at the revision the attempt saw, so no release is missed.
        return False

    async def unwatch(self, name: str) -> None:
        count = self._watched.get(name, 0) - 1
        if count > 0:
            self._watched[name] = count
            return
        self._watched.pop(name, None)
        slot = self.slots.get(name)
        if slot is not None:
            self._unwatch_slot(slot)

    def _watch_slot(self, name: str, slot: _Slot) -> None:
        if not self._watched.get(name) or slot.pred is None or slot.held:
            return
        key, seen_at = slot.pred
        if slot.watch is not None:
            if slot.watch[0] == key:
                return
            self._unwatch_slot(slot)

        def on_event(kind: str, revision: int) -> None:
            if kind == "canceled" and slot.watch is not None and slot.watch[1] == watch_id:
                slot.watch = None  # compacted history: the next attempt looks afresh
            self._wake(name)

        watch_id = self.client.watch(key, seen_at + 1, on_event)
        slot.watch = (key, watch_id)

    def _unwatch_slot(self, slot: _Slot) -> None:
        if slot.watch is not None:
            self.client.cancel_watch(slot.watch[1])
            slot.watch = None

    def _watches_reset(self) -> None:
        for name, slot in self.slots.items():
            if slot.watch is not None:
                slot.watch = None
                self._wake(name)
