"""Every asynclock exception survives pickling (Celery result backends, process pools)."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import sys

import pytest

import asynclock
import asynclock.backends

SAMPLES: dict[str, asynclock.AsynclockError] = {
    "AsynclockError": asynclock.AsynclockError("something went wrong"),
    "LockHeld": asynclock.LockHeld("report:7", 1.25, None, "web-1:4242"),
    "AlreadyHeld": asynclock.AlreadyHeld("report:7", 42),
    "RestartGrace": asynclock.RestartGrace(
        "report:7", 2.5, 1_790_000_000.25, "redis://h/0 lost its data"
    ),
    "AcquireTimeout": asynclock.AcquireTimeout("report:7", 3.0),
    "LeaseLost": asynclock.LeaseLost("report:7", 42, "renewal refused: not ours"),
    "StaleToken": asynclock.StaleToken("ledger:1", 41, 42),
    "BackendUnavailable": asynclock.BackendUnavailable("redis://h: connection refused"),
    "QuorumNotReached": asynclock.QuorumNotReached(
        "2 of 3 nodes did not answer", {"h1": "timeout", "h2": "refused"}
    ),
    "InProgress": asynclock.InProgress("order:7", 2.5),
    "IdempotencyKeyReused": asynclock.IdempotencyKeyReused("order:7"),
    "ReplayedFailure": asynclock.ReplayedFailure("order:7", "app.CardDeclined", "declined"),
    "SemaphoreLimitMismatch": asynclock.SemaphoreLimitMismatch("pool", 3, 5),
}


#: Constructor arguments of exceptions defined by a backend module.
BACKEND_ARGS: dict[str, tuple[object, ...]] = {
    "EtcdError": ("etcd://h:2379: Range failed: connection refused", "UNAVAILABLE"),
}


def all_exception_classes() -> list[type[asynclock.AsynclockError]]:
    for module in pkgutil.iter_modules(asynclock.backends.__path__):
        importlib.import_module(f"asynclock.backends.{module.name}")
    found: list[type[asynclock.AsynclockError]] = []
    todo: list[type[asynclock.AsynclockError]] = [asynclock.AsynclockError]
    while todo:
        cls = todo.pop()
        importable = getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls
        if importable and not cls.__name__.startswith("_"):
            found.append(cls)  # (a class made at run time cannot be unpickled anyway)
        todo.extend(cls.__subclasses__())
    return found


def sample(cls: type[asynclock.AsynclockError]) -> asynclock.AsynclockError:
    if cls.__name__ in SAMPLES:
        return SAMPLES[cls.__name__]
    if cls.__name__ in BACKEND_ARGS:
        return cls(*BACKEND_ARGS[cls.__name__])
    # A subclass elsewhere (e.g. PoolerDetected) takes its base's constructor arguments.
    base = next(b for b in cls.__mro__[1:] if b.__name__ in SAMPLES)
    return cls(*SAMPLES[base.__name__].args)


@pytest.mark.parametrize("cls", all_exception_classes(), ids=lambda c: c.__qualname__)
def test_pickle_round_trip_keeps_message_and_fields(cls: type[asynclock.AsynclockError]) -> None:
    original = sample(cls)
    assert type(original) is cls
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == str(original)
    assert copy.args == original.args
    assert vars(copy) == vars(original)


def test_the_samples_cover_the_fields() -> None:
    lost = pickle.loads(pickle.dumps(SAMPLES["LeaseLost"]))
    assert isinstance(lost, asynclock.LeaseLost)
    assert (lost.name, lost.token, lost.reason) == ("report:7", 42, "renewal refused: not ours")
    quorum = pickle.loads(pickle.dumps(SAMPLES["QuorumNotReached"]))
    assert isinstance(quorum, asynclock.QuorumNotReached)
    assert quorum.failures == {"h1": "timeout", "h2": "refused"}


@pytest.mark.parametrize("name", ["LockHeld", "LeaseLost", "StaleToken"])
def test_args_rebuild_the_exception(name: str) -> None:
    """Celery's JSON result backend stores ``args`` and rebuilds with ``cls(*args)``."""
    original = SAMPLES[name]
    copy = type(original)(*original.args)
    assert str(copy) == str(original)
    assert vars(copy) == vars(original)


def test_every_asynclock_error_is_an_exception() -> None:
    # Not a BaseException only: Celery's on_failure and autoretry see only Exceptions.
    for cls in all_exception_classes():
        assert issubclass(cls, Exception), cls
    assert issubclass(asynclock.AcquireTimeout, TimeoutError)
    assert issubclass(asynclock.BackendUnavailable, ConnectionError)
