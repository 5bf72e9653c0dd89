"""The guard's plumbing: the lock dependency put first in an endpoint's signature, and the
``guard_lease`` dependency that reads the request's state it keeps."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Depends, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError

from asynclock import (
    AcquireTimeout,
    BackendUnavailable,
    Lease,
    LeaseLost,
    LockHeld,
    NameTemplate,
    RestartGrace,
)

from ._common import (
    _REQUEST_PARAM,
    _RESPONSE_PARAM,
    GUARD_ATTR,
    INSTALLED_KEY,
    STATE_KEY,
    GuardInfo,
    LostDuringResponse,
    _grace_of,
    _GuardState,
    _retry_after,
    grace_unavailable,
    lock_service_unavailable,
)

if TYPE_CHECKING:
    from ._locks import Locks

logger = logging.getLogger("asynclock_fastapi")


def _typed_signature(func: Callable[..., Any]) -> inspect.Signature:
    """The signature with string annotations evaluated in the endpoint's own module.

    The wrapper FastAPI sees lives in this module, so unresolved names would be looked up
    in the wrong globals.
    """
    try:
        return inspect.signature(func, eval_str=True)
    except (NameError, TypeError, SyntaxError):
        return inspect.signature(func)


def _depend_on(param: inspect.Parameter, lease_of: Callable[..., Any]) -> inspect.Parameter:
    """``param`` with ``Depends(guard_lease)`` replaced by ``Depends(lease_of)``."""
    default = param.default
    if getattr(default, "dependency", None) is guard_lease:
        param = param.replace(default=Depends(lease_of, use_cache=default.use_cache))
    metadata = getattr(param.annotation, "__metadata__", ())
    if any(getattr(m, "dependency", None) is guard_lease for m in metadata):
        swapped = tuple(
            Depends(lease_of) if getattr(m, "dependency", None) is guard_lease else m
            for m in metadata
        )
        param = param.replace(annotation=Annotated[(param.annotation.__origin__, *swapped)])
    return param


def _is_guard_lease(param: inspect.Parameter) -> bool:
    default = param.default
    if getattr(default, "dependency", None) is guard_lease:
        return True
    for meta in getattr(param.annotation, "__metadata__", ()):
        if getattr(meta, "dependency", None) is guard_lease:
            return True
    return False


def _is_plain(param: inspect.Parameter) -> bool:
    """A required ``name: str`` parameter: FastAPI takes it from the path, else the query.

    Declaring it again on the lock dependency would make FastAPI validate it a second time, which
    cost ~60 Python calls a request (cProfile), about 7 % of a guarded request.
    """
    return param.annotation is str and param.default is inspect.Parameter.empty


def _make_lock_dependency(
    locks: Locks,
    template: NameTemplate,
    fields: list[inspect.Parameter],
    info: GuardInfo,
    timeout: float | None,
    max_hold: float | None,
    lost_retry: str | None,
    outage_retry: str,
    scope: Literal["request", "function"],
) -> Callable[..., AsyncIterator[_GuardState]]:
    """The guard's dependency with ``yield``: acquire, run the request inside, release."""
    ttl, busy_status, header = info.ttl, info.busy_status, info.header
    blocking = timeout is not None
    plain = [p.name for p in fields if _is_plain(p)]
    in_response = scope == "request"  # the lock outlives the endpoint: it spans the response

    async def lock_dependency(**values: Any) -> AsyncIterator[_GuardState]:
        request: Request = values.pop(_REQUEST_PARAM)
        response: Response = values.pop(_RESPONSE_PARAM)
        for field in plain:
            # A required `str` path or query parameter: FastAPI's validation would
            # return the value as it is (see _is_plain), so it is read directly.
            value = request.path_params.get(field)
            if value is None:
                value = request.query_params.get(field)
                if value is None:
                    raise RequestValidationError(
                        [{"type": "missing", "loc": ("query", field), "msg": "Field required"}]
                    )
            values[field] = value
        try:
            name = template.format(values)
        except ValueError as exc:  # e.g. longer than a lock name may be: the input's fault
            raise HTTPException(422, detail=f"cannot make the lock name: {exc}") from None
        lock = locks.backend.lock(
            name, ttl=ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
        )
        state = request.scope[STATE_KEY] = _GuardState()
        try:
            async with lock as lease:
                state.lease = lease
                if header is not None:
                    response.headers[header] = str(lease.token)
                yield state
        except RestartGrace as exc:
            if state.lease is not None:
                raise  # from the request's own code, not from our acquire
            raise grace_unavailable(exc.retry_after, exc.until) from None
        except (LockHeld, AcquireTimeout) as exc:
            if state.lease is not None:
                raise
            if isinstance(exc, AcquireTimeout) and exc.detail is not None:
                # The wait ran out with something to say: a restart grace, if the server
                # still has one, is an outage with a known end (503), not a conflict.
                grace = await _grace_of(locks.backend, name)
                if grace is not None:
                    raise grace_unavailable(*grace) from None
            retry = _retry_after(exc.retry_after) if isinstance(exc, LockHeld) else None
            raise HTTPException(
                busy_status,
                detail=f"busy: {exc}",
                headers=None if retry is None else {"Retry-After": retry},
            ) from None
        except BackendUnavailable as exc:
            if state.lease is not None:
                raise
            raise lock_service_unavailable(
                request.method, request.url.path, exc, outage_retry
            ) from None
        except LeaseLost as exc:
            lease_ = state.lease
            if lease_ is None or not lease_.lost or exc.token != lease_.token:
                raise  # another lease's loss, raised by the request's own code
            if state.returned and in_response:
                # The response may have started: only the middleware can tell (see
                # ResponsePhase); with scope "function" it never has, so 503 below.
                if not request.scope.get(INSTALLED_KEY):
                    logger.warning(
                        "%s %s: lease lost after the endpoint returned; call "
                        "asynclock_fastapi.install(app) to end such responses without a "
                        "server traceback",
                        request.method,
                        request.url.path,
                    )
                raise LostDuringResponse(exc, int(lost_retry or 0)) from exc
            headers = {} if lost_retry is None else {"Retry-After": lost_retry}
            logger.warning(
                "guarded request %s %s stopped: %s", request.method, request.url.path, exc
            )
            raise HTTPException(
                503, detail=f"lock lost, the request was stopped: {exc}", headers=headers
            ) from None

    # FastAPI reads the dependency's parameters from its signature: the template's fields
    # are the endpoint's own parameters (same types, defaults, Query()/Path()/Depends()),
    # so the name is made from validated values.
    params = [
        inspect.Parameter(_REQUEST_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Request),
        inspect.Parameter(_RESPONSE_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Response),
        *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in fields if not _is_plain(p)),
    ]
    lock_dependency.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return lock_dependency


async def guard_lease(request: Request) -> Lease:
    """Dependency: the lease of the ``@guard`` on this route (``Depends(guard_lease)``).

    The guard acquires before FastAPI resolves the endpoint's own parameters, so this is
    the guard's lease. Route- or app-level ``dependencies=[...]`` run before the guard and
    get an error here; outside a guarded route, ``asynclock.current_lease()`` still gives
    the innermost ``backend.lock()`` of the task.
    """
    state = request.scope.get(STATE_KEY)
    if isinstance(state, _GuardState) and state.lease is not None:
        return state.lease
    if guard_info(request.scope.get("endpoint")) is not None:
        # A guarded route, and the lock dependency has not run: it was skipped because the lock
        # name's parameters failed validation (FastAPI is collecting those errors), or
        # this is a route-level dependency, which runs before the guard.
        raise HTTPException(
            422,
            detail="no lock was taken for this request: the lock name's parameters are "
            "invalid (or guard_lease is used by a route-level dependency, which runs "
            "before the guard acquires)",
        )
    raise RuntimeError(
        f"guard_lease was resolved on {request.method} {request.url.path}, which is not "
        "guarded: put @locks.guard(...) under the route decorator"
    )


def guard_info(endpoint: object) -> GuardInfo | None:
    """The :class:`GuardInfo` of a guarded endpoint, else None."""
    info = getattr(endpoint, GUARD_ATTR, None)
    return info if isinstance(info, GuardInfo) else None


def responses_of(info: GuardInfo) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses a guarded route adds: busy and lost."""
    retry = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    return {
        info.busy_status: {
            "description": f"Busy: the lock {info.template.template!r} is held by another "
            "request (or was not acquired within the guard's timeout)",
            "headers": retry,
        },
        503: {
            "description": f"The lock {info.template.template!r} was lost while the request "
            "ran (its work was cancelled), or the lock server is in its restart grace (it "
            "lost its data a short while ago and grants no lock until the grace ends) or "
            "cannot be reached. Retry after Retry-After seconds.",
            "headers": retry,
        },
    }
