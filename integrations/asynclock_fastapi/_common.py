"""What the guard's parts share: names in the ASGI scope, a request's state, the 503 answers."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import HTTPException

from asynclock import (
    Backend,
    BackendUnavailable,
    Lease,
    LeaseLost,
    NameTemplate,
)

logger = logging.getLogger("asynclock_fastapi")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]

#: The request header (and response header) that carries a fencing token.
DEFAULT_HEADER = "Fencing-Token"
#: Where a guarded request keeps its :class:`_GuardState` in the ASGI scope (read by
#: ``guard_lease``).
STATE_KEY = "asynclock_fastapi.state"
#: Set in the ASGI scope by the middleware ``install`` adds.
INSTALLED_KEY = "asynclock_fastapi.installed"
#: Attribute on a guarded endpoint: its :class:`GuardInfo` (read by ``install`` for OpenAPI).
GUARD_ATTR = "__asynclock_guard__"
#: Where an idempotent request keeps the response being captured (``_idempotent.Capture``),
#: read by ``ResponsePhase`` for every message it sends.
CAPTURE_KEY = "asynclock_fastapi.capture"
#: The lock dependency's parameter, put first in a guarded endpoint's signature.
_LOCK_PARAM = "asynclock_fastapi_lock_"
_REQUEST_PARAM = "asynclock_fastapi_request_"
_RESPONSE_PARAM = "asynclock_fastapi_response_"


class LostDuringResponse(Exception):
    """The guard's lease was lost after the endpoint returned (the response phase).

    Raised by the lock dependency; the middleware that :func:`asynclock_fastapi.install`
    adds answers 503 if nothing was sent yet, else ends the response without completing it
    (the client sees a truncated body, never a complete-looking one) and logs one warning.
    """

    def __init__(self, lost: LeaseLost, retry_after: int) -> None:
        super().__init__(str(lost))
        self.lost = lost
        self.retry_after = retry_after


class IdempotentAnswer(Exception):
    """An idempotent request's error answer, raised where the response may be captured
    already (after the key dependency's ``yield``): ``ResponsePhase`` drops what was held
    back and sends this instead (a 503 for a lost lease or an unreachable lock server)."""

    def __init__(self, status: int, detail: str, retry_after: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.retry_after = retry_after


class _GuardState:
    """One guarded request's state, shared by the lock dependency, the endpoint wrapper and
    guard_lease."""

    __slots__ = ("lease", "lost_answered", "returned")

    def __init__(self) -> None:
        self.lease: Lease | None = None
        #: The endpoint returned: from here on a loss is in the response phase.
        self.returned = False
        #: The loss was answered (503) inside the route, by the endpoint held around it.
        self.lost_answered = False


class GuardInfo:
    """What a guard does, for OpenAPI and tools: its template, ttl, busy status, header."""

    __slots__ = ("busy_status", "header", "template", "ttl")

    def __init__(self, template: NameTemplate, ttl: float, busy_status: int, header: str | None):
        self.template = template
        self.ttl = ttl
        self.busy_status = busy_status
        self.header = header


def check_header_name(header: object, what: str = "header") -> str:
    """A valid HTTP header name (RFC 9110 token), or ValueError saying what is allowed."""
    allowed = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if not isinstance(header, str) or not header or any(c not in allowed for c in header):
        raise ValueError(
            f"{what} must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~), "
            f"got {header!r}"
        )
    return header


def _retry_after(seconds: float | None) -> str | None:
    return None if seconds is None else str(max(1, math.ceil(seconds)))


def grace_unavailable(retry_after: float | None, until: float) -> HTTPException:
    """503 for a restart grace: the server grants nothing until ``until`` (a Unix time).

    Unavailable, not a conflict: nobody holds the name, the lock server lost its data a
    short while ago and waits until a lease granted before the loss has surely ended. The
    exception's own words name the server; the client gets the grace's end only.
    """
    end = datetime.fromtimestamp(until, UTC).isoformat(timespec="milliseconds")
    retry = _retry_after(retry_after) or "1"
    return HTTPException(
        503,
        detail=f"the lock server is in its restart grace until {end} (it lost its data a "
        "short while ago, and a lock granted before may still be held), so the request was "
        f"not run; retry in {retry}s",
        headers={"Retry-After": retry},
    )


def lock_service_unavailable(method: str, path: str, exc: Exception, retry: str) -> HTTPException:
    """503 for a lock server that cannot be reached; the cause goes to the log only (it
    names the server, which is none of the client's business)."""
    logger.warning("%s %s: lock server unavailable: %s", method, path, exc)
    return HTTPException(
        503,
        detail="the lock server is unavailable, so the request was not run; retry later",
        headers={"Retry-After": retry},
    )


async def _grace_of(backend: Backend, name: str) -> tuple[float | None, float] | None:
    """Seconds left and end of the server's restart grace for ``name``, if it still has one."""
    try:
        found = await backend.holder(name)
    except (BackendUnavailable, NotImplementedError):
        return None
    if found is None or found.grace_until is None:
        return None
    return found.remaining, found.grace_until
