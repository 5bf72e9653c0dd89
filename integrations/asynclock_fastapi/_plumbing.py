"""The guard's plumbing: the lock dependency put first in an endpoint's signature, and the
``guard_lease`` dependency that reads the request's state it keeps."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import TYPE_CHECKING, Annotated, Any

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

try:  # the otel extra: the request's span carries the guard's token
    from asynclock.otel import annotate_current_span
except ImportError:  # pragma: no cover - depends on the environment
    annotate_current_span = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ._locks import Locks

logger = logging.getLogger("asynclock_fastapi")
Scope = MutableMapping[str, Any]


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


def missing_query(field: str) -> RequestValidationError:
    """422 for a required plain ``str`` field of the lock name missing from the query."""
    return RequestValidationError(
        [{"type": "missing", "loc": ("query", field), "msg": "Field required"}]
    )


def annotate_span(lease: Lease, template: NameTemplate) -> None:
    """The lease's token and the guard's template on the request's span, if one records
    (OpenTelemetry's FastAPI/ASGI instrumentation's server span)."""
    if annotate_current_span is not None:
        annotate_current_span(lease, template.template)


def lock_name(template: NameTemplate, values: dict[str, Any]) -> str:
    """The lock name of a request; 422 if it cannot be made (e.g. too long: the input's fault)."""
    try:
        return template.format(values)
    except ValueError as exc:
        raise HTTPException(422, detail=f"cannot make the lock name: {exc}") from None


class Answers:
    """How a guard answers what its lock raised; shared by both ways a guard holds its lease
    (the lock dependency here, the route wrapper in ``_route``)."""

    __slots__ = ("busy_status", "in_response", "locks", "lost_retry", "outage_retry")

    def __init__(
        self,
        locks: Locks,
        busy_status: int,
        lost_retry: str | None,
        outage_retry: str,
        in_response: bool,
    ) -> None:
        self.locks = locks
        self.busy_status = busy_status
        self.lost_retry = lost_retry
        self.outage_retry = outage_retry
        #: The lock outlives the endpoint: it spans the response (``release="response"``).
        self.in_response = in_response

    def lost(self, exc: LeaseLost, scope: Scope) -> HTTPException:
        """503 for the guard's lease lost before the endpoint returned."""
        request = Request(scope)
        headers = {} if self.lost_retry is None else {"Retry-After": self.lost_retry}
        logger.warning("guarded request %s %s stopped: %s", request.method, request.url.path, exc)
        return HTTPException(
            503, detail=f"lock lost, the request was stopped: {exc}", headers=headers
        )

    async def raise_for(self, exc: Exception, state: _GuardState, name: str, scope: Scope) -> None:
        """Raise the answer to ``exc``, raised by the lock ``name`` or inside it; return if
        ``exc`` is not the guard's own (the caller re-raises it)."""
        if isinstance(exc, LeaseLost):
            lease = state.lease
            if lease is None or not lease.lost or exc.token != lease.token:
                return  # another lease's loss, raised by the request's own code
            if state.returned and self.in_response:
                # The response may have started: only the middleware can tell (see
                # ResponsePhase); with scope "function" it never has, so 503 below.
                if not scope.get(INSTALLED_KEY):
                    request = Request(scope)
                    logger.warning(
                        "%s %s: lease lost after the endpoint returned; call "
                        "asynclock_fastapi.install(app) to end such responses without a "
                        "server traceback",
                        request.method,
                        request.url.path,
                    )
                raise LostDuringResponse(exc, int(self.lost_retry or 0)) from exc
            raise self.lost(exc, scope) from None
        if state.lease is not None:
            return  # from the request's own code, not from our acquire
        if isinstance(exc, RestartGrace):
            raise grace_unavailable(exc.retry_after, exc.until) from None
        if isinstance(exc, LockHeld | AcquireTimeout):
            if isinstance(exc, AcquireTimeout) and exc.detail is not None:
                # The wait ran out with something to say: a restart grace, if the server
                # still has one, is an outage with a known end (503), not a conflict.
                grace = await _grace_of(self.locks.backend, name)
                if grace is not None:
                    raise grace_unavailable(*grace) from None
            retry = _retry_after(exc.retry_after) if isinstance(exc, LockHeld) else None
            raise HTTPException(
                self.busy_status,
                detail=f"busy: {exc}",
                headers=None if retry is None else {"Retry-After": retry},
            ) from None
        if isinstance(exc, BackendUnavailable):
            request = Request(scope)
            raise lock_service_unavailable(
                request.method, request.url.path, exc, self.outage_retry
            ) from None


def _make_lock_dependency(
    locks: Locks,
    template: NameTemplate,
    fields: list[inspect.Parameter],
    info: GuardInfo,
    timeout: float | None,
    max_hold: float | None,
    answers: Answers,
) -> Callable[..., AsyncIterator[_GuardState]]:
    """The guard's dependency with ``yield``: acquire, run the request inside, release."""
    ttl, header = info.ttl, info.header
    blocking = timeout is not None
    plain = [p.name for p in fields if _is_plain(p)]

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
                    raise missing_query(field)
            values[field] = value
        name = lock_name(template, values)
        lock = locks.backend.lock(
            name, ttl=ttl, timeout=timeout, blocking=blocking, max_hold=max_hold
        )
        state = request.scope[STATE_KEY] = _GuardState()
        try:
            async with lock as lease:
                state.lease = lease
                annotate_span(lease, template)
                if header is not None:
                    response.headers[header] = str(lease.token)
                yield state
        except (LockHeld, AcquireTimeout, BackendUnavailable, LeaseLost) as exc:
            await answers.raise_for(exc, state, name, request.scope)
            raise

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
