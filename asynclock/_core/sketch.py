"""A fixed-memory histogram of durations, for quantiles with a stated error bound.

Buckets grow geometrically by ``GAMMA = 2 ** (1/8)`` (8 per doubling) from ``LOW`` (1 µs) to
``HIGH`` (about 27 hours), :data:`BUCKETS` of them, one ``array('I')`` of 4-byte counts:
:data:`SKETCH_BYTES` of counts per sketch, whatever it is fed. A quantile is reported as
the point of its bucket that is nearest, relatively, to every value the bucket holds, so
for a duration in range the answer is within :data:`RELATIVE_ERROR` (4.3 %) of a value
of the requested rank (DDSketch's bound, with a fixed range instead of a collapsing one).
Durations below ``LOW`` count in the first bucket (reported as at most ``LOW``); above
``HIGH``, in the last one (and :attr:`LogHistogram.max` keeps the exact largest).
"""

from __future__ import annotations

import math
from array import array

PER_DOUBLING = 8
GAMMA: float = 2.0 ** (1 / PER_DOUBLING)
#: Bound on |reported - true| / true for a quantile of durations in [LOW, HIGH].
RELATIVE_ERROR = (GAMMA - 1) / (GAMMA + 1)
LOW = 1e-6
BUCKETS = 1 + PER_DOUBLING * 37  # 2**37 µs ≈ 38 hours
HIGH: float = LOW * GAMMA ** (BUCKETS - 1)
#: Bytes of bucket counts per sketch (the object itself adds about 150 more).
SKETCH_BYTES = 4 * BUCKETS

_log2 = math.log2
_ZEROS = bytes(SKETCH_BYTES)


class LogHistogram:
    """Counts of durations (seconds) in :data:`BUCKETS` log-spaced buckets."""

    __slots__ = ("count", "counts", "max", "total")

    def __init__(self) -> None:
        self.counts = array("I", _ZEROS)
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        """Count one duration (negative and NaN values count as zero)."""
        if seconds > LOW:
            i = int(_log2(seconds / LOW) * PER_DOUBLING)
            # (the bucket of ``x``: LOW * GAMMA**i < x <= LOW * GAMMA**(i+1), i.e. index i+1)
            self.counts[i + 1 if i + 1 < BUCKETS else BUCKETS - 1] += 1
        else:
            self.counts[0] += 1
            seconds = max(seconds, 0.0) if seconds == seconds else 0.0
        self.count += 1
        self.total += seconds
        if seconds > self.max:
            self.max = seconds

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0..1) of the durations counted (nearest rank), within
        :data:`RELATIVE_ERROR`; 0.0 when nothing was counted."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be from 0 to 1, got {q!r}")
        if self.count == 0:
            return 0.0
        rank = max(1, math.ceil(q * self.count))  # the rank-th smallest value
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return min(value_of(i), self.max)
        return self.max  # pragma: no cover - the counts add up to count

    def merge(self, other: LogHistogram) -> None:
        """Add ``other``'s counts to this one's."""
        counts = self.counts
        for i, n in enumerate(other.counts):
            if n:
                counts[i] += n
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)


def value_of(i: int) -> float:
    """The value reported for bucket ``i``: relatively nearest to all it holds."""
    if i == 0:
        return LOW
    upper: float = LOW * GAMMA**i
    return 2 * upper / (GAMMA + 1)  # between upper/GAMMA and upper
