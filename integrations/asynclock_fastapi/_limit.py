"""``@locks.limit(template, n, ttl=...)``: at most ``n`` requests of a route (or of one
name made from its parameters) in flight at once across every worker of the fleet.

Each request holds one of ``n`` permits of ``backend.semaphore(name, n)`` while its
endpoint runs (``async with sem.acquire(...)``, renewed by the backend): a lost permit
cancels the endpoint and answers 503, as a guard's lost lease does. A request that finds
every permit held answers ``busy_status`` (429 Too Many Requests) with ``Retry-After``,
at once or after waiting up to ``timeout`` seconds.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException

import asynclock
from asynclock import (
    AcquireTimeout,
    BackendUnavailable,
    LeaseLost,
    LockHeld,
    NameTemplate,
    RestartGrace,
)

from ._common import F, _retry_after, grace_unavailable
from ._plumbing import _typed_signature
from ._route import ROUTE_ATTR

if TYPE_CHECKING:
    from ._locks import Locks

logger = logging.getLogger("asynclock_fastapi")

#: The largest ``n`` (the core's cap on a semaphore's limit).
MAX_LIMIT = 10_000

_PERMIT: ContextVar[asynclock.Permit | None] = ContextVar("asynclock_fastapi_permit", default=None)


def current_permit() -> asynclock.Permit:
    """The permit the running ``@locks.limit`` endpoint holds (``.slot``, ``.token``).

    Raises:
        LookupError: outside an endpoint under ``@locks.limit``.
    """
    permit = _PERMIT.get()
    if permit is None:
        raise LookupError("no permit here: current_permit() works inside a @locks.limit endpoint")
    return permit


def make_limit(
    locks: Locks,
    template: str,
    limit: int,
    *,
    ttl: float,
    timeout: float | None,
    busy_status: int,
    retry_after: float,
) -> Callable[[F], F]:
    """``Locks.limit`` (its options are checked there and here)."""
    name_template = NameTemplate(template)
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}")
    if timeout is not None:
        timeout = asynclock.check_seconds(timeout, "timeout", zero=True)
    busy_retry = _retry_after(asynclock.check_seconds(retry_after, "retry_after", zero=True))
    assert busy_retry is not None
    if isinstance(busy_status, bool) or not isinstance(busy_status, int):
        raise TypeError(f"busy_status must be an int HTTP status, got {busy_status!r}")
    if not 400 <= busy_status <= 599:
        raise ValueError(f"busy_status must be a 4xx or 5xx status, got {busy_status}")
    lost_retry = _retry_after(ttl) or "1"

    def decorate(endpoint: F) -> F:
        if not inspect.iscoroutinefunction(endpoint):
            what = getattr(endpoint, "__qualname__", repr(endpoint))
            raise TypeError(
                f"@limit needs an `async def` endpoint, and {what} is not one: a sync "
                "endpoint runs in a worker thread that a lost permit cannot interrupt"
            )
        signature = _typed_signature(endpoint)
        name_template.check_parameters(
            signature.parameters, what=f"the endpoint {endpoint.__qualname__}()"
        )
        fields = name_template.fields

        @functools.wraps(endpoint)
        async def limited(*args: Any, **kwargs: Any) -> Any:
            name = name_template.format({f: kwargs[f] for f in fields})
            sem = locks.backend.semaphore(name, limit)
            hold = sem.acquire(ttl=ttl, timeout=timeout, blocking=timeout is not None)
            permit: asynclock.Permit | None = None
            try:
                async with hold as permit:
                    reset = _PERMIT.set(permit)
                    try:
                        return await endpoint(*args, **kwargs)
                    finally:
                        _PERMIT.reset(reset)
            except RestartGrace as exc:
                if permit is not None:
                    raise
                raise grace_unavailable(exc.retry_after, exc.until) from None
            except (LockHeld, AcquireTimeout) as exc:
                if permit is not None:
                    raise  # the endpoint's own
                raise HTTPException(
                    busy_status,
                    detail=f"busy: all {limit} permits of {name!r} are held ({exc})",
                    headers={"Retry-After": busy_retry},
                ) from None
            except BackendUnavailable as exc:
                if permit is not None:
                    raise
                logger.warning("limit %r: lock server unavailable: %s", name, exc)
                raise HTTPException(
                    503,
                    detail="the lock server is unavailable, so the request was not run; "
                    "retry later",
                    headers={"Retry-After": busy_retry},
                ) from None
            except LeaseLost as exc:
                if permit is None or not permit.lost or exc.token != permit.token:
                    raise  # another lease's loss
                logger.warning("limited request %r stopped: %s", name, exc)
                raise HTTPException(
                    503,
                    detail=f"permit lost, the request was stopped: {exc}",
                    headers={"Retry-After": lost_retry},
                ) from None

        limited.__signature__ = signature  # type: ignore[attr-defined]
        # Over a @locks.guard: its guard holds through the dependency, never around the
        # route (which would call the endpoint beside this wrapper, past the limit).
        limited.__dict__.pop(ROUTE_ATTR, None)
        return limited  # type: ignore[return-value]

    return decorate
