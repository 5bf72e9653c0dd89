"""What the ZooKeeper driver keeps of a node of ours and writes into it, and its error texts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._kazoo import NoAuthError

#: How far a local clock may run slow against the server's (as the core's default).
DRIFT = 0.01
#: Taken off the session deadline besides the drift: room for a late wake-up of this
#: loop (a loaded process) and the cancelled work to stop, before the server expires it.
MARGIN = 0.15
_TAG = b"asynclock"


def explain(exc: BaseException) -> str | None:
    if isinstance(exc, NoAuthError):
        return (
            "not authorised by the node's ACL (NoAuth): check the digest user and password "
            "(zookeeper://user:password@host/...)"
        )
    if isinstance(exc, TimeoutError):
        return "no answer in time (is the ensemble reachable, and does it have a quorum?)"
    return None


def encode_data(owner: str, ttl: float) -> bytes:
    return b"%s\n%s\n%r" % (_TAG, owner.encode(), ttl)


def decode_data(data: bytes) -> tuple[str | None, float | None]:
    """(owner, ttl) of our nodes; (the data as text or None, None) of anyone else's."""
    parts = data.split(b"\n")
    if len(parts) == 3 and parts[0] == _TAG:
        try:
            return parts[1].decode(), float(parts[2])
        except ValueError:
            pass
    text = data.decode("utf-8", "replace")
    return (text or None), None


@dataclass(slots=True)
class Node:
    name: str
    owner: str
    path: str  # the full path of our child node
    token: int
    ttl: float
    expires_at: float  # local clock: last confirmed renewal's t_send + ttl
    session: int | None  # the session the node was created on (it lives as long)
    releasing: bool = False  # our own delete is on its way: its watch event is no loss
    gone: bool = False  # its watch saw it deleted: the next renewal is refused


class HeldLocks(dict[str, Node]):
    """The driver's held lock nodes by owner, and a lower bound of their expiries: a node's
    expiry only moves later (renewals) and :meth:`add` lowers the bound, so :meth:`expire`
    walks them only once the earliest can have passed. It walked them on every wake-up of
    the housekeeping, and every grant wakes it: 100,000 grants walked 100,000 nodes each."""

    due: float = math.inf

    def add(self, owner: str, node: Node) -> None:
        self[owner] = node
        self.due = min(self.due, node.expires_at)

    def expire(self, now: float) -> list[Node]:
        """Forget the nodes whose expiry has passed (the core stopped renewing them) and
        return them; :attr:`due` is then when the next one is."""
        if now < self.due:
            return []
        expired, due = [], math.inf
        for owner, node in list(self.items()):
            if now >= node.expires_at:
                del self[owner]
                expired.append(node)
            else:
                due = min(due, node.expires_at)
        self.due = due
        return expired
