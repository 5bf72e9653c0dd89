"""The public surface is small and deliberate (STYLE: private core, public facade)."""

from __future__ import annotations

import subprocess
import sys

import asynclock
import asynclock.fence
import asynclock.from_thread
import asynclock.idempotency
import asynclock.testing

PUBLIC = {
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
    "ServerFull",
    "StaleToken",
    "Term",
    "__version__",
    "check_seconds",
    "connect",
    "current_lease",
    "partition_of",
    "serve_stats",
    "use_lease",
}


def test_all_is_exactly_the_public_api() -> None:
    assert isinstance(asynclock.__all__, tuple)
    assert set(asynclock.__all__) == PUBLIC
    for name in asynclock.__all__:
        assert hasattr(asynclock, name), name


def test_submodule_all() -> None:
    assert set(asynclock.testing.__all__) == {
        "DriverFaults",
        "ManualClock",
        "force_loss",
        "memory_backend",
        "next_renewal_round",
    }
    assert "SQLFence" in asynclock.fence.__all__
    assert asynclock.from_thread.__all__ == ("LoopThread", "guard", "hold", "idempotent")
    assert "KeyedCalls" in asynclock.idempotency.__all__
    for module in (
        asynclock.testing,
        asynclock.fence,
        asynclock.from_thread,
        asynclock.idempotency,
    ):
        assert isinstance(module.__all__, tuple)
        for name in module.__all__:
            assert hasattr(module, name)


def test_driver_api_for_backend_authors() -> None:
    import asynclock.backends as backends

    assert set(backends.__all__) == {
        "Busy",
        "Driver",
        "ExtendResult",
        "LeaseRef",
        "Record",
        "Refused",
    }
    assert backends.Driver is asynclock.Driver


def test_exception_hierarchy() -> None:
    for name in (
        "AcquireTimeout",
        "BackendUnavailable",
        "LeaseLost",
        "LockHeld",
        "QuorumNotReached",
        "ServerFull",
        "StaleToken",
        "InProgress",
        "IdempotencyKeyReused",
        "ReplayedFailure",
    ):
        assert issubclass(getattr(asynclock, name), asynclock.AsynclockError)
    assert issubclass(asynclock.AcquireTimeout, TimeoutError)
    assert issubclass(asynclock.BackendUnavailable, ConnectionError)
    assert issubclass(asynclock.QuorumNotReached, asynclock.BackendUnavailable)
    # A server's ceiling is not an outage: code that retries on BackendUnavailable must not
    # hammer a full lock table, and nothing held is lost with it.
    assert not issubclass(asynclock.ServerFull, asynclock.BackendUnavailable)
    # A restart grace is a wait with a known end: code that treats busy as "later" still works.
    assert issubclass(asynclock.RestartGrace, asynclock.LockHeld)
    # Same key, other arguments: a caller's mistake, like a bad argument.
    assert issubclass(asynclock.IdempotencyKeyReused, ValueError)


def test_core_imports_without_optional_drivers() -> None:
    """Importing asynclock must not import redis, asyncpg, etcd clients or rich."""
    code = (
        "import sys, asynclock, asynclock.fence, asynclock.testing;"
        "bad = [m for m in ('redis', 'asyncpg', 'aetcd', 'grpc', 'rich', 'celery', 'fastapi',"
        " 'kazoo')"
        " if m in sys.modules]; print(bad); raise SystemExit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=50
    )
    assert done.returncode == 0, done.stdout + done.stderr
