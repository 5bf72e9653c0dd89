"""A SQLite waiter's polling schedule, and which SQLite errors mean "busy, try again"."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

#: How long a queued waiter keeps its place without asking again.
WAITER_TTL = 0.5
#: Poll delays: the head of the queue polls fast, backing off while the hold goes on.
HEAD_POLL = 0.0005
HEAD_MAX_POLL = 0.005
MAX_POLL = 0.05
#: With release datagrams the head only polls as a fallback (lost datagram, expiry).
NOTIFIED_MAX_POLL = 0.05
#: With release datagrams a waiter behind the head does not poll: it is woken when its
#: turn comes (see waking.py), so this only bounds a wake-up that got lost.
BEHIND_POLL = 10.0


@dataclass(slots=True)
class _Waiting:
    """What a queued waiter learned on its last attempt."""

    version: tuple[int, int] = (0, 0)
    until: float = 0.0  # the holder's expiry (no cheap skip after it)
    refreshed: float = 0.0  # when our queue entry was last written
    ahead: int = 0
    attempts: int = 0
    notified: bool = False  # a release datagram will wake us
    woken: bool = False  # a wake-up came for us since the last attempt

    def waits_turn(self) -> bool:
        """Behind the head, with nothing heard since: nothing to ask the database."""
        return self.notified and self.ahead > 0 and not self.woken

    def delay(self, now: float) -> float:
        if self.notified and self.ahead > 0:
            return BEHIND_POLL
        if self.notified:
            cap = NOTIFIED_MAX_POLL
            step = cap
        else:
            cap = HEAD_MAX_POLL if self.ahead == 0 else MAX_POLL
            step = HEAD_POLL * (1 + 4 * self.ahead) * 1.25 ** min(self.attempts, 30)
        left = self.until - now if self.until > now else cap
        return max(0.0, min(step, cap, left, WAITER_TTL / 3))


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)
