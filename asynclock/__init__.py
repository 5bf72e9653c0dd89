"""asynclock: distributed locks that are honest about time.

Every acquisition yields a fencing token; the holder's work is cancelled when the lease is
lost; resource-side fences reject stale writers. Start with :func:`connect`.
"""

from ._core.advice import Advice
from ._core.backend import Backend
from ._core.clock import Clock, MonotonicClock
from ._core.connect import connect
from ._core.context import current_lease, use_lease
from ._core.driver import Driver
from ._core.exceptions import (
    AcquireTimeout,
    AlreadyHeld,
    AsynclockError,
    BackendUnavailable,
    IdempotencyKeyReused,
    InProgress,
    LeaseLost,
    LockHeld,
    QuorumNotReached,
    ReplayedFailure,
    RestartGrace,
    SemaphoreLimitMismatch,
    ServerFull,
    StaleToken,
)
from ._core.holder import Holder
from ._core.idempotency import Idempotent, IdempotentCall
from ._core.leadership import Leader, Leadership, Term
from ._core.lease import Lease, LossSignal
from ._core.lock import Lock
from ._core.lock_all import HeldLocks, LockAll
from ._core.observer import Observer
from ._core.partition_rules import partition_of
from ._core.partitions import Partition, PartitionMember, PartitionOwner, Partitions
from ._core.rwlock import RWHold, RWLock
from ._core.semaphore import Permit, Semaphore
from ._core.stats import BackendStats, HoldTimes
from ._core.templates import NameTemplate
from ._core.validation import MAX_TTL, check_seconds
from ._ops.serve import serve_stats
from ._version import __version__

__all__ = (
    "AcquireTimeout",
    "Advice",
    "AlreadyHeld",
    "AsynclockError",
    "Backend",
    "BackendStats",
    "BackendUnavailable",
    "Clock",
    "Driver",
    "HeldLocks",
    "HoldTimes",
    "Holder",
    "IdempotencyKeyReused",
    "Idempotent",
    "IdempotentCall",
    "InProgress",
    "Lease",
    "Leader",
    "Leadership",
    "LeaseLost",
    "Lock",
    "LockAll",
    "LockHeld",
    "LossSignal",
    "MAX_TTL",
    "MonotonicClock",
    "NameTemplate",
    "Observer",
    "QuorumNotReached",
    "ServerFull",
    "ReplayedFailure",
    "Partition",
    "PartitionMember",
    "PartitionOwner",
    "Partitions",
    "Permit",
    "RestartGrace",
    "RWHold",
    "RWLock",
    "Semaphore",
    "SemaphoreLimitMismatch",
    "StaleToken",
    "Term",
    "__version__",
    "check_seconds",
    "connect",
    "current_lease",
    "partition_of",
    "serve_stats",
    "use_lease",
)
