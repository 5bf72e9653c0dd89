"""An etcd driver's sessions (one etcd lease per ttl in use) and its per-name slots."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Server and client clocks may run at slightly different rates.
SERVER_DRIFT = 0.01


def requested_ttl(ttl: float) -> int:
    """The whole seconds asked of etcd for locks of ``ttl`` (the server may grant more):
    the next whole second above ``ttl``, so a key outlives the local deadline, and etcd's
    remaining TTL (whole seconds, rounded down) never reads above ``ttl``."""
    return max(1, math.floor(ttl) + 1)


@dataclass(eq=False)
class Session:
    """One etcd lease shared by every lock of one ttl in this process."""

    ttl: float
    lease_id: int
    granted: int
    #: Our clock, read before the last acknowledged keep-alive (or the grant) was sent: the
    #: server's lease lives at least ``granted`` seconds past it.
    acked_at: float
    users: int = 0
    idle_since: float | None = None
    dead: bool = False

    @property
    def headroom(self) -> float:
        """How much longer than a lock's ttl the lease lives after a keep-alive."""
        return self.granted * (1 - SERVER_DRIFT) - self.ttl

    @property
    def interval(self) -> float:
        """Keep-alive period: often enough that a new lock of ``ttl`` usually fits without
        a keep-alive of its own (see :meth:`EtcdDriver._fresh`)."""
        if self.headroom < 0.1:
            return self.granted / 3
        return max(0.05, min(self.granted / 3, self.headroom / 2))


@dataclass(frozen=True, slots=True)
class Predecessor:
    """An etcd waiter's :attr:`Busy.cursor <asynclock.Driver>`: the key its own key queues
    behind and the revision the failed attempt read; its watch starts just after it, so a
    release in between is not missed."""

    owner: str
    key: bytes
    revision: int


@dataclass(eq=False)
class _Slot:
    """This process's one participant in etcd for a name."""

    name: str
    owner: str
    ttl: float
    session: Session | None = None
    key: bytes = b""  # our key (named after the session it was created on)
    rev: int | None = None  # our key's create revision, once known
    held: bool = False
    expires_at: float = math.inf  # held: when the core's lease would have ended
    watch: tuple[bytes, int, int] | None = None  # (watched key, start revision, watch id)
    holder_lease: int = 0  # the etcd lease of the holder seen by the last attempt
