"""The keep-alives of every etcd lease on one shared stream, each ack paired with its request."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from . import _proto as pb
from ._stream import Stream

if TYPE_CHECKING:
    from .client import EtcdClient


class _Waiter:
    """One pending keep-alive acknowledgement."""

    __slots__ = ("error", "event", "ttl")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.ttl: int | None = None
        self.error: BaseException | None = None


class KeepAlives:
    """The keep-alive requests sent on ``client``'s keep-alive stream, each waiting for its
    ack. The client bounds the wait (:meth:`EtcdClient.keep_alive`)."""

    def __init__(self, client: EtcdClient) -> None:
        self._pending: dict[int, deque[_Waiter]] = {}
        #: The highest store revision an ack carried.
        self.revision = 0
        self.stream = Stream(
            client,
            "/etcdserverpb.Lease/LeaseKeepAlive",
            pb.LeaseKeepAliveResponse,
            self._on_reply,
            self._fail,
        )

    def send(self, lease_ids: Sequence[int]) -> list[tuple[int, _Waiter]]:
        """One keep-alive request per lease, queued on the stream."""
        waiters: list[tuple[int, _Waiter]] = []
        for lease_id in lease_ids:
            waiter = _Waiter()
            self._pending.setdefault(lease_id, deque()).append(waiter)
            self.stream.send(pb.LeaseKeepAliveRequest(ID=lease_id))
            waiters.append((lease_id, waiter))
        return waiters

    @staticmethod
    async def acks(waiters: Sequence[tuple[int, _Waiter]]) -> dict[int, int]:
        """The TTL each ack carries (<= 0: the lease is gone); raises the stream's error
        if it broke first. An unanswered waiter stays in line (until its ack, or the stream
        breaks): acks come back in order, so a late ack must answer its own request, never a
        later one — that would date the lease from the later send, after the server
        refreshed it."""
        result: dict[int, int] = {}
        for lease_id, waiter in waiters:
            await waiter.event.wait()
            if waiter.error is not None:
                raise waiter.error
            assert waiter.ttl is not None
            result[lease_id] = waiter.ttl
        return result

    def _on_reply(self, reply: Any) -> None:
        self.revision = max(self.revision, reply.header.revision)
        pending = self._pending.get(reply.ID)
        if pending:
            waiter = pending.popleft()
            if not pending:
                del self._pending[reply.ID]
            waiter.ttl = reply.TTL
            waiter.event.set()

    def _fail(self, error: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for waiters in pending.values():
            for waiter in waiters:
                waiter.error = error
                waiter.event.set()
