"""How a backend takes part in the conformance suite."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asynclock

#: What each backend of the conformance suite can do (``BackendSpec.can``): one table, so a
#: test asks the spec instead of keeping its own set of backend ids.
#:
#: * ``records`` — stores idempotency records (``backend.idempotent``; Redlock refuses);
#: * ``names`` — lists the names it holds (``backend.holders()``, ``asynclock list``);
#: * ``leader`` — tells who holds a name (``backend.leader()``: the server keeps owners);
#: * ``server_ttl`` — the server keeps each lease's expiry (PostgreSQL session mode keeps
#:   a lock for its session instead);
#: * ``claims`` — ``backend.claims()`` (PostgreSQL);
#: * ``multiprocess`` — separate processes share its locks through the URL;
#: * ``semaphore`` — ``backend.semaphore()`` (others raise NotImplementedError);
#: * ``rwlock`` — ``backend.rwlock()`` (others raise NotImplementedError);
#: * ``holds`` — ``sem.holders()`` and ``rw.holders()`` list the live permits and
#:   read-write holds (``asynclock holder``; others raise NotImplementedError);
#: * ``session_holds`` — a permit or read-write hold has no expiry at the server: it lasts
#:   as long as its holder's session (``Holder.remaining`` is None; ZooKeeper).
CAPABILITIES: dict[str, frozenset[str]] = {
    backend_id: frozenset(caps.split())
    for backend_id, caps in {
        "memory": "records names leader server_ttl semaphore rwlock holds",
        "sqlite": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "postgres": "records claims multiprocess semaphore rwlock holds",
        "postgres_lease": (
            "records names leader server_ttl claims multiprocess semaphore rwlock holds"
        ),
        "redis": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "redlock": "server_ttl multiprocess",
        "redis_sentinel": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "redis_cluster": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "etcd": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "etcd3": "records names leader server_ttl multiprocess semaphore rwlock holds",
        "zookeeper": "names leader multiprocess semaphore rwlock holds session_holds",
        "zookeeper3": "names leader multiprocess semaphore rwlock holds session_holds",
    }.items()
}


def backends_with(capability: str, among: list[str] | None = None) -> list[str]:
    """The backend ids (of ``among``, default every one) that have ``capability``."""
    return [b for b in (among or list(CAPABILITIES)) if capability in CAPABILITIES[b]]


@dataclass(frozen=True)
class BackendSpec:
    """One backend under test, on a server the test session started.

    ``sabotage(backend, name)`` deletes the live lease of ``name`` behind the holder's back
    using raw server access (not asynclock), so the next renewal is refused.
    ``multiprocess`` says whether separate processes share locks through ``url``.
    ``queued(name)`` counts, with raw server access, what the server keeps for the waiters
    of ``name`` (queue entries, contender keys or nodes, waiter locks; the holder's own
    entry too where the server cannot tell it apart): None where the server keeps nothing
    per waiter.
    """

    id: str
    url: str
    sabotage: Callable[[asynclock.Backend, str], Awaitable[None]]
    multiprocess: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    queued: Callable[[str], Awaitable[int]] | None = None

    def can(self, capability: str) -> bool:
        """Whether this backend has ``capability`` (see :data:`CAPABILITIES`)."""
        return capability in CAPABILITIES[self.id]

    def connect(self, **extra: Any) -> asynclock.Backend:
        return asynclock.connect(self.url, **{**self.options, **extra})


def specs_split_by(capability: str) -> tuple[Any, Any]:
    """Two fixtures for a module testing ``capability``: ``spec`` over the backends that
    have it and ``other_spec`` over the others (each test runs where it applies: nothing
    is skipped). In the module: ``spec, other_spec = specs_split_by("semaphore")``."""
    import pytest

    have = backends_with(capability)

    @pytest.fixture(params=have)
    def spec(request: pytest.FixtureRequest) -> BackendSpec:
        result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
        return result

    @pytest.fixture(params=[b for b in CAPABILITIES if b not in have])
    def other_spec(request: pytest.FixtureRequest) -> BackendSpec:
        result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
        return result

    return spec, other_spec
