"""Per-backend statistics, a plain snapshot object."""

from __future__ import annotations

import logging
import math
import re
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HoldTimes:
    """Percentiles (seconds) over the most recent completed holds; zero when none."""

    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


@dataclass(frozen=True, slots=True)
class BackendStats:
    """What a backend did since it was opened.

    ``renewal_round_trips`` counts calls to the server; ``renewals`` counts leases
    extended (one call renews many leases). ``renewals_late`` counts leases whose renewal
    was sent with less than half of their margin left: the renewer (or the event loop)
    falling behind, before any deadline passed (a WARNING says so too).
    """

    held: int = 0
    acquired: int = 0
    released: int = 0
    busy_attempts: int = 0
    renewals: int = 0
    renewal_round_trips: int = 0
    renewal_errors: int = 0
    renewals_late: int = 0
    losses: int = 0
    loss_reasons: dict[str, int] = field(default_factory=dict)
    hold_times: HoldTimes = field(default_factory=HoldTimes)


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


class StatsRecorder:
    """Mutable counters behind :class:`BackendStats`."""

    def __init__(self, window: int = 4096) -> None:
        self.acquired = 0
        self.released = 0
        self.busy_attempts = 0
        self.renewals = 0
        self.renewal_round_trips = 0
        self.renewal_errors = 0
        self.renewals_late = 0
        self.losses = 0
        self.loss_reasons: Counter[str] = Counter()
        #: Durations of the most recent completed holds (append a hold's seconds).
        self.hold_times: deque[float] = deque(maxlen=window)

    def snapshot(self, held: int) -> BackendStats:
        ordered = sorted(self.hold_times)
        holds = HoldTimes(
            count=len(ordered),
            p50=_percentile(ordered, 0.50),
            p90=_percentile(ordered, 0.90),
            p99=_percentile(ordered, 0.99),
            max=ordered[-1] if ordered else 0.0,
        )
        return BackendStats(
            held=held,
            acquired=self.acquired,
            released=self.released,
            busy_attempts=self.busy_attempts,
            renewals=self.renewals,
            renewal_round_trips=self.renewal_round_trips,
            renewal_errors=self.renewal_errors,
            renewals_late=self.renewals_late,
            losses=self.losses,
            loss_reasons=dict(self.loss_reasons),
            hold_times=holds,
        )


def loss_kind(reason: str) -> str:
    """The kind of a loss reason, for ``stats().loss_reasons`` and metrics: the reason up
    to its first detail (``"renewal refused: ..."`` -> ``"renewal refused"``)."""
    # ("()" names a call, "lock broken by break_lock()": not the start of a detail.)
    return re.split(r"[:;]|\((?!\))", reason, maxsplit=1)[0].strip()


#: Release failures within this many seconds of the last one logged are summed up.
RELEASE_STORM = 1.0


class ReleaseStorm:
    """Releases the server did not confirm, logged at WARNING; a storm of them (many
    blocks exiting at once against a server in trouble) logs its first one and then one
    summary line per :data:`RELEASE_STORM` seconds, not one line per lease."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._until = -math.inf
        self._count = 0
        self._last = ""

    def failed(self, what: str, now: float) -> None:
        if now >= self._until:
            self.flush()
            self._logger.warning("release of %s", what)
            self._until = now + RELEASE_STORM
            return
        self._count += 1
        self._last = what

    def flush(self) -> None:
        """Log the summary of the failures counted since the last line, if any."""
        if self._count:
            self._logger.warning(
                "%d more releases were not confirmed (each lease expires at the server "
                "within its ttl); the last: %s",
                self._count,
                self._last,
            )
            self._count = 0
