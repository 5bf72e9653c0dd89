"""FastAPI integration: guarded routes that stop on loss, the lease dependency, the HTTP fence.

Holder side::

    from asynclock_fastapi import Locks, guard_lease, install

    locks = Locks("redis://127.0.0.1:6379/0")
    app = install(FastAPI(lifespan=locks.lifespan))

    @app.post("/accounts/{account_id}/rebuild")
    @locks.guard("account:{account_id}", ttl=10)
    async def rebuild(account_id: str, lease: Lease = Depends(guard_lease)): ...

Fleet-wide limits: ``@locks.limit("export", 4, ttl=10)`` under ``@app.post(...)``: at most
4 requests in the endpoint at once across every worker, the rest 429 with ``Retry-After``.

Retried requests: ``@locks.idempotent(ttl=10)`` under ``@app.post(...)`` answers a request
that repeats an ``Idempotency-Key`` with the first answer (IETF draft; needs ``install``).

Resource side: ``token: int = Depends(fencing_token)`` and a fence (``SQLFence``,
``RedisFence``) in the write; a stale token answers 412, a missing one 428.
Client side: ``httpx.AsyncClient(auth=FencingAuth())`` sends the current lease's token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._common import DEFAULT_HEADER, GuardInfo, LostDuringResponse
from ._fence import (
    MAX_TOKEN,
    FencedWrite,
    FencedWrites,
    FencingToken,
    fence_responses,
    fenced_write,
    fencing_token,
)
from ._handlers import ResponsePhase, install
from ._idempotency_key import IdempotencyInfo, idempotency_info
from ._limit import current_permit
from ._locks import Locks
from ._plumbing import guard_info, guard_lease

if TYPE_CHECKING:
    from ._client import FencingAuth

__all__ = (
    "DEFAULT_HEADER",
    "MAX_TOKEN",
    "FencedWrite",
    "FencedWrites",
    "FencingAuth",
    "FencingToken",
    "GuardInfo",
    "IdempotencyInfo",
    "Locks",
    "LostDuringResponse",
    "ResponsePhase",
    "current_permit",
    "guard_lease",
    "fence_responses",
    "fenced_write",
    "fencing_token",
    "guard_info",
    "idempotency_info",
    "install",
)


def __getattr__(name: str) -> Any:
    # httpx is imported only by code that sends requests (a service may never need it).
    if name == "FencingAuth":
        from ._client import FencingAuth

        return FencingAuth
    raise AttributeError(f"module 'asynclock_fastapi' has no attribute {name!r}")
