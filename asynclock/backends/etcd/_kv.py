"""etcd requests on a lock's keys: reads in creation order, revision guards, guarded deletes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _proto as pb
from .client import prefix_end

if TYPE_CHECKING:
    from .client import EtcdClient


def by_creation(
    prefix: bytes, end: bytes, order: Any, *, limit: int, below: int | None = None
) -> Any:
    """A txn op reading the keys under ``prefix`` in creation order (``order``: first or
    newest first), ``limit`` of them, keys only; ``below``: created before that revision."""
    return pb.RequestOp(
        request_range=pb.RangeRequest(
            key=prefix,
            range_end=end,
            sort_order=order,
            sort_target=pb.SORT_TARGET_CREATE,
            max_create_revision=0 if below is None else below - 1,
            limit=limit,
            keys_only=True,
        )
    )


def created_at(key: bytes, revision: int) -> Any:
    return pb.Compare(
        result=pb.CMP_EQUAL, target=pb.CMP_TARGET_CREATE, key=key, create_revision=revision
    )


async def first_key(client: EtcdClient, prefix: bytes, *, keys_only: bool = False) -> Any:
    """The key with the lowest create revision under the lock's prefix (the holder)."""
    reply = await client.range(
        pb.RangeRequest(
            key=prefix,
            range_end=prefix_end(prefix),
            sort_order=pb.SORT_ASCEND,
            sort_target=pb.SORT_TARGET_CREATE,
            limit=1,
            keys_only=keys_only,
        )
    )
    return reply.kvs[0] if reply.kvs else None


def guard(key: bytes, rev: int | None, owner: bytes | None) -> Any:
    """The compare that ``key`` is still the one we wrote: same create revision, or (the
    revision unknown: the reply to our put was lost) the same owner in its value."""
    if rev is not None:
        return created_at(key, rev)
    if owner is not None:
        return pb.Compare(result=pb.CMP_EQUAL, target=pb.CMP_TARGET_VALUE, key=key, value=owner)
    raise ValueError("a delete needs the key's create revision or its owner")


async def delete_key(client: EtcdClient, key: bytes, rev: int | None, owner: bytes | None) -> bool:
    """Delete ``key`` if it is still the one we wrote (see :func:`guard`)."""
    delete = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))
    reply = await client.txn(pb.TxnRequest(compare=[guard(key, rev, owner)], success=[delete]))
    return bool(reply.succeeded)


async def lease_left(client: EtcdClient, kvs: Any) -> dict[int, float]:
    """Seconds (whole, rounded down) each lease of ``kvs`` has left at the server; a lease
    that has just expired (its keys being deleted) is left out."""
    left: dict[int, float] = {}
    for lease in {kv.lease for kv in kvs if kv.lease}:
        reply = await client.time_to_live(lease, keys=False)
        if reply.TTL >= 0:
            left[lease] = float(reply.TTL)
    return left


def live_left(kv: Any, left: dict[int, float]) -> tuple[bool, float | None]:
    """Whether ``kv`` is live (no lease, or one not expired) and its seconds left."""
    if not kv.lease:
        return True, None
    return kv.lease in left, left.get(kv.lease)
