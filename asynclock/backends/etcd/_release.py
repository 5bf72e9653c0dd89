"""The etcd driver's release path: our key deleted, guarded by its create revision (G5);
the deletes made while one is in flight go out together, one Txn per batch (issue 45
item 3: 50,000 blocks exiting at once sent 50,000 Txns over ~14 s, and the leases at the
end of the line passed their local deadline first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .._common.coalesce import Coalesced
from . import _proto as pb
from ._kv import delete_key, guard
from ._session import _Slot
from .client import EtcdClient

#: The most deletes one Txn carries: etcd's default ``--max-txn-ops`` (a server started
#: with a lower one refuses our batches; each then falls back to one Txn per delete).
TXN_OPS = 128

#: A delete: our key, its create revision (None: unknown) and our owner id (its value).
Delete = tuple[bytes, "int | None", bytes]


class Releasing:
    """The release half of :class:`~asynclock.backends.etcd.EtcdDriver` (a mixin over its
    state)."""

    client: EtcdClient
    display: str
    slots: dict[str, _Slot]
    _orphans: dict[bytes, tuple[int | None, bytes]]

    if TYPE_CHECKING:

        def _free(self, name: str, slot: _Slot) -> None: ...

    def _init_releasing(self) -> None:
        self._deletes: Coalesced[Delete, bool] = Coalesced(
            self._delete_one, self._delete_many, limit=TXN_OPS, what=f"{self.display}: release"
        )

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        slot = self.slots.get(name)
        if slot is None or slot.owner != owner:
            return False
        if token is not None and (not slot.held or slot.rev != token):
            return False
        if token is not None:
            # Local state changes only once the server confirmed (G6): a failed release
            # keeps the slot, so it can be retried (or expires with its ttl). Our own
            # delete is no loss (``releasing``), but if it fails after all, the key is
            # gone if the deletions watch saw it go.
            slot.releasing = True
            try:
                removed = await self._delete_own(slot)
            finally:
                slot.releasing = False
            self._free(name, slot)
            return removed
        return await self._drop(slot)

    async def _drop(self, slot: _Slot) -> bool:
        """Delete the key of a slot that does not hold (an interrupted or abandoned
        attempt) and free the slot; if the delete fails, it is retried in the background
        so the next task here is not stuck behind it."""
        try:
            return await self._delete_own(slot)
        except BaseException:
            if slot.session is not None and not slot.session.dead:
                self._orphans[slot.key] = (slot.rev, slot.owner.encode())
            raise
        finally:
            self._free(slot.name, slot)

    async def _delete_own(self, slot: _Slot) -> bool:
        """Delete our key (owner-checked by its create revision when we know it)."""
        if slot.session is None:
            return False
        return await self._deletes(slot.key, (slot.key, slot.rev, slot.owner.encode()))

    async def _delete_one(self, delete: Delete) -> bool:
        return await delete_key(self.client, *delete)

    async def _delete_many(self, deletes: list[Delete]) -> list[bool | BaseException]:
        """One Txn: every key deleted if every guard holds (the usual case: they are our
        keys, deleted only by us); if one does not, nothing was deleted and each is sent
        alone, so each caller gets its own answer."""
        if len(deletes) == 1:
            return [await self._delete_one(deletes[0])]
        reply = await self.client.txn(
            pb.TxnRequest(
                compare=[guard(*delete) for delete in deletes],
                success=[
                    pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=delete[0]))
                    for delete in deletes
                ],
            )
        )
        if reply.succeeded:
            return [True] * len(deletes)
        answers: list[bool | BaseException] = [False] * len(deletes)

        async def alone(i: int) -> None:
            try:
                answers[i] = await self._delete_one(deletes[i])
            except Exception as exc:
                answers[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(len(deletes)):
                tg.start_soon(alone, i)
        return answers
