"""The holder side: ``Locks`` opens a backend in the lifespan; ``guard`` holds a lease per request.

How a guarded request runs (the timing the docs promise, each point tested):

1. FastAPI resolves the endpoint's dependencies in parameter order. The guard puts its own
   *hold* dependency (a dependency with ``yield``) first, so the lease is acquired before
   any other dependency of the endpoint's own parameters, ``current_lease`` included.
2. The hold enters ``async with backend.lock(...)``: the rest of the request runs inside
   the lock's cancel scope. A lost lease cancels whatever runs then (the endpoint, a
   dependency, the streaming body, a background task), the ``async with`` raises
   ``LeaseLost``, and the hold turns it into a 503 with ``Retry-After`` (or, once the
   response has started, ends it quietly; see ``_handlers``).
3. The lease is released when FastAPI exits the hold: with the default scope
   (``release="response"``) after the response is sent *and* its background tasks ran;
   with ``release="endpoint"`` (FastAPI's ``Depends(scope="function")``) as soon as the
   endpoint returns, before the response is sent.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError

import asynclock
from asynclock import (
    AcquireTimeout,
    Backend,
    BackendUnavailable,
    Lease,
    LeaseLost,
    LockHeld,
    NameTemplate,
    RestartGrace,
)

logger = logging.getLogger("asynclock_fastapi")

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]

#: The request header (and response header) that carries a fencing token.
DEFAULT_HEADER = "Fencing-Token"
#: Where a guarded request keeps its hold in the ASGI scope (read by ``current_lease``).
HOLD_KEY = "asynclock_fastapi.hold"
#: Set in the ASGI scope by the middleware ``install`` adds.
INSTALLED_KEY = "asynclock_fastapi.installed"
#: Attribute on a guarded endpoint: its :class:`GuardInfo` (read by ``install`` for OpenAPI).
GUARD_ATTR = "__asynclock_guard__"
_HOLD_PARAM = "asynclock_fastapi_hold_"
_REQUEST_PARAM = "asynclock_fastapi_request_"
_RESPONSE_PARAM = "asynclock_fastapi_response_"


class LostDuringResponse(Exception):
    """The guard's lease was lost after the endpoint returned (the response phase).

    Raised by the hold; the middleware that :func:`asynclock_fastapi.install` adds answers
    503 if nothing was sent yet, else ends the response without completing it (the client
    sees a truncated body, never a complete-looking one) and logs one warning.
    """

    def __init__(self, lost: LeaseLost, retry_after: int) -> None:
        super().__init__(str(lost))
        self.lost = lost
        self.retry_after = retry_after


class _Hold:
    """One guarded request's state, shared by the hold, the endpoint wrapper and current_lease."""

    __slots__ = ("lease", "returned")

    def __init__(self) -> None:
        self.lease: Lease | None = None
        #: The endpoint returned: from here on a loss is in the response phase.
        self.returned = False


class GuardInfo:
    """What a guard does, for OpenAPI and tools: its template, ttl, busy status, header."""

    __slots__ = ("busy_status", "header", "template", "ttl")

    def __init__(self, template: NameTemplate, ttl: float, busy_status: int, header: str | None):
        self.template = template
        self.ttl = ttl
        self.busy_status = busy_status
        self.header = header


def _check_seconds(value: object, what: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        allowed = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number of seconds {allowed}, got {value!r}")
    return seconds


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


class Locks:
    """One asynclock backend for a FastAPI app, opened and closed by the app's lifespan.

    ::

        locks = Locks("redis://127.0.0.1:6379/0")
        app = FastAPI(lifespan=locks.lifespan)

    Args:
        url: any ``asynclock.connect`` URL (``redis://``, ``postgresql://``, ``sqlite:///``...).
        backend: instead of a URL, a ``Backend`` you made; ``lifespan`` opens and closes it.
        options: passed to ``asynclock.connect`` with ``url``.
    """

    def __init__(self, url: str | None = None, *, backend: Backend | None = None, **options: Any):
        if (url is None) == (backend is None):
            raise TypeError("Locks() takes a backend URL or backend=, exactly one of them")
        if backend is not None and not isinstance(backend, Backend):
            raise TypeError(f"backend= must be an asynclock Backend, not {type(backend).__name__}")
        if backend is not None and options:
            raise TypeError(f"connect options ({', '.join(options)}) go with a URL, not backend=")
        if url is not None and not isinstance(url, str):
            raise TypeError(f"url must be an asynclock URL str, not {type(url).__name__}")
        self._url = url
        self._options = options
        self._given = backend
        self._backend: Backend | None = None

    def __repr__(self) -> str:
        state = "open" if self._backend is not None else "closed"
        where = self._url if self._url is not None else repr(self._given)
        return f"<asynclock_fastapi.Locks {where} {state}>"

    @property
    def backend(self) -> Backend:
        """The open backend (only while the app's lifespan runs)."""
        if self._backend is None:
            raise RuntimeError(
                "Locks is not open: pass lifespan=locks.lifespan to FastAPI(...), or enter "
                "`async with locks.lifespan(app):` inside your own lifespan"
            )
        return self._backend

    @asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """Open the backend for the app's life: ``FastAPI(lifespan=locks.lifespan)``.

        Inside your own lifespan: ``async with locks.lifespan(app): yield``; or let
        :meth:`wrap` combine the two.
        """
        if self._backend is not None:
            raise RuntimeError("this Locks is already open (one lifespan at a time)")
        backend = self._given if self._given is not None else self._connect()
        async with backend:
            self._backend = backend
            try:
                yield
            finally:
                self._backend = None

    def _connect(self) -> Backend:
        assert self._url is not None
        return asynclock.connect(self._url, **self._options)

    def wrap(self, lifespan: Lifespan) -> Lifespan:
        """Your lifespan inside this one: ``FastAPI(lifespan=locks.wrap(my_lifespan))``.

        The backend opens first (your start-up code can take locks) and closes last; the
        state your lifespan yields is passed on to the app.
        """
        if not callable(lifespan):
            raise TypeError(f"wrap() takes a lifespan callable, not {type(lifespan).__name__}")

        @asynccontextmanager
        async def combined(app: Any) -> AsyncIterator[Any]:
            async with self.lifespan(app), lifespan(app) as state:
                yield state

        return combined

    def _check_lease_ttl(self, ttl: float) -> float:
        """What the backend checks of a lease's ttl at every acquire, checked once here, so
        a bad guard fails where it is declared, not on every request. (The core's check is
        private; its messages are repeated word for word.)"""
        if ttl > asynclock.MAX_TTL:
            raise ValueError(
                f"ttl must be at most {asynclock.MAX_TTL:g} seconds (7 days), got {ttl!r}; the "
                "lease is renewed every ttl/3 while held, so hold as long as you like with a "
                "short ttl (bound the hold with max_hold)"
            )
        if self._given is not None:
            drift, margin = self._given.drift, self._given.margin
        else:
            defaults = inspect.signature(asynclock.connect).parameters
            drift = self._options.get("drift", defaults["drift"].default)
            margin = self._options.get("margin", defaults["margin"].default)
            if not all(isinstance(v, int | float) for v in (drift, margin)):
                return ttl  # connect() says what is wrong with them when the app starts
        if ttl * (1 - drift) - margin <= 0:
            raise ValueError(
                f"ttl={ttl:g}s leaves no time after drift ({drift:.0%}) and margin "
                f"({margin:g}s); use a ttl of at least {2 * margin + 0.001:g}s"
            )
        return ttl

    def guard(
        self,
        template: str,
        *,
        ttl: float,
        timeout: float | None = None,
        max_hold: float | None = None,
        release: Literal["response", "endpoint"] = "response",
        busy_status: int = 409,
        retry_after: float | None = None,
        header: str | None = DEFAULT_HEADER,
    ) -> Callable[[F], F]:
        """Hold the lock ``template`` (formatted from the endpoint's parameters) per request.

        Put it under the route decorator (``@app.post(...)`` then ``@locks.guard(...)``).

        Args:
            template: lock name with fields naming endpoint parameters (path, query, header
                or dependency values), e.g. ``"account:{account_id}"``; checked now.
            ttl: the lease ttl; it is renewed while the request runs.
            timeout: ``None`` (default): busy answers ``busy_status`` at once. A number:
                wait up to that many seconds for the lock, then answer ``busy_status``.
            max_hold: give the lease up (503) after this long, however well it renews.
            release: ``"response"`` (default) releases after the response was sent and its
                background tasks ran; ``"endpoint"`` when the endpoint returns, before the
                response is sent (FastAPI's ``Depends(scope="function")``).
            busy_status: the status of a busy answer (default 409 Conflict). A restart
                grace of the lock server is not busy: it answers 503 with ``Retry-After``
                the seconds left of the grace.
            retry_after: the ``Retry-After`` seconds of a 503 after a loss (default: the
                ttl, the longest the lost lease can keep the name at the server) and of a
                503 when the lock server cannot be reached (default: 1).
            header: response header carrying the token (``None``: no header).

        Raises:
            TypeError: a sync ``def`` endpoint (it cannot be interrupted when the lease is
                lost), or a template field the endpoint does not take.
            ValueError: an option the backend would refuse at every request: a ttl above
                ``asynclock.MAX_TTL`` or too short for the backend's drift and margin.
        """
        name_template = NameTemplate(template)
        ttl = self._check_lease_ttl(_check_seconds(ttl, "ttl", allow_zero=False))
        if timeout is not None:
            timeout = _check_seconds(timeout, "timeout", allow_zero=True)
        if max_hold is not None:
            max_hold = _check_seconds(max_hold, "max_hold", allow_zero=False)
        if retry_after is not None:
            retry_after = _check_seconds(retry_after, "retry_after", allow_zero=True)
        if release not in ("response", "endpoint"):
            raise ValueError(f"release must be 'response' or 'endpoint', got {release!r}")
        if isinstance(busy_status, bool) or not isinstance(busy_status, int):
            raise TypeError(f"busy_status must be an int HTTP status, got {busy_status!r}")
        if not 400 <= busy_status <= 599:
            raise ValueError(f"busy_status must be a 4xx or 5xx status, got {busy_status}")
        if header is not None:
            header = check_header_name(header, "header")
        info = GuardInfo(name_template, ttl, busy_status, header)
        lost_retry = _retry_after(ttl if retry_after is None else retry_after)
        # A lock server that cannot be reached may be back in a moment: 1 s unless told.
        outage_retry = _retry_after(retry_after) or "1"
        scope: Literal["request", "function"] = "request" if release == "response" else "function"
        locks = self

        def decorate(endpoint: F) -> F:
            if not inspect.iscoroutinefunction(endpoint):
                what = getattr(endpoint, "__qualname__", repr(endpoint))
                raise TypeError(
                    f"@guard needs an `async def` endpoint, and {what} is not one: a sync "
                    "endpoint runs in a worker thread that a lost lease cannot interrupt; "
                    "make it `async def` (run blocking parts with anyio.to_thread.run_sync "
                    "and check lease.check() between them)"
                )
            if hasattr(endpoint, GUARD_ATTR):
                raise TypeError(f"{endpoint.__qualname__} is guarded twice; use one @guard")
            signature = _typed_signature(endpoint)
            name_template.check_parameters(
                signature.parameters, what=f"the endpoint {endpoint.__qualname__}()"
            )
            if _HOLD_PARAM in signature.parameters:
                raise TypeError(f"an endpoint parameter may not be named {_HOLD_PARAM!r}")
            fields = [signature.parameters[f] for f in name_template.fields]
            for param in fields:
                if _is_current_lease(param):
                    raise TypeError(
                        f"lock name template {template!r} uses {param.name}, the guard's own "
                        "lease: name the lock after the request's parameters instead"
                    )
            hold = _make_hold(
                locks,
                name_template,
                fields,
                info,
                timeout,
                max_hold,
                lost_retry,
                outage_retry,
                scope,
            )

            @functools.wraps(endpoint)
            async def guarded(*args: Any, **kwargs: Any) -> Any:
                state: _Hold = kwargs.pop(_HOLD_PARAM)
                result = await endpoint(*args, **kwargs)
                if state.lease is not None:
                    # Lost while the endpoint ran but it reached no checkpoint after the
                    # cancellation (or the loop was frozen past the deadline): its work
                    # is not known to have been exclusive, so the answer is 503 too.
                    state.lease.check()
                state.returned = True
                if header is not None and isinstance(result, Response) and state.lease:
                    result.headers[header] = str(state.lease.token)
                return result

            hold_depends = Depends(hold, scope=scope)
            hidden = [
                inspect.Parameter(
                    _HOLD_PARAM, inspect.Parameter.KEYWORD_ONLY, default=hold_depends
                ),
            ]

            async def lease_of(state: _Hold = hold_depends) -> Lease:
                assert state.lease is not None
                return state.lease

            # The endpoint's own `Depends(current_lease)` parameters depend on the hold
            # itself, so FastAPI skips them (and answers 422) when the hold's parameters
            # fail validation, instead of asking for a lease that was never taken.
            params = [_depend_on(p, lease_of) for p in signature.parameters.values()]
            if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
                raise TypeError(
                    f"{endpoint.__qualname__}: a guarded endpoint takes named parameters "
                    "only (FastAPI passes every value by name), not *args, **kwargs or /"
                )
            # The hold goes first: FastAPI resolves dependencies in parameter order, so the
            # lease exists before current_lease (or anything using it) is resolved. All
            # keyword-only, so defaults need no ordering (FastAPI passes values by name).
            keyword = [p.replace(kind=p.KEYWORD_ONLY) for p in params]
            guarded.__signature__ = signature.replace(  # type: ignore[attr-defined]
                parameters=[*hidden, *keyword]
            )
            setattr(guarded, GUARD_ATTR, info)
            return guarded  # type: ignore[return-value]

        return decorate


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
    """``param`` with ``Depends(current_lease)`` replaced by ``Depends(lease_of)``."""
    default = param.default
    if getattr(default, "dependency", None) is current_lease:
        param = param.replace(default=Depends(lease_of, use_cache=default.use_cache))
    metadata = getattr(param.annotation, "__metadata__", ())
    if any(getattr(m, "dependency", None) is current_lease for m in metadata):
        swapped = tuple(
            Depends(lease_of) if getattr(m, "dependency", None) is current_lease else m
            for m in metadata
        )
        param = param.replace(annotation=Annotated[(param.annotation.__origin__, *swapped)])
    return param


def _is_current_lease(param: inspect.Parameter) -> bool:
    default = param.default
    if getattr(default, "dependency", None) is current_lease:
        return True
    for meta in getattr(param.annotation, "__metadata__", ()):
        if getattr(meta, "dependency", None) is current_lease:
            return True
    return False


def _is_plain(param: inspect.Parameter) -> bool:
    """A required ``name: str`` parameter: FastAPI takes it from the path, else the query.

    Declaring it again on the hold would make FastAPI validate it a second time, which
    cost ~60 Python calls a request (cProfile), about 7 % of a guarded request.
    """
    return param.annotation is str and param.default is inspect.Parameter.empty


def _make_hold(
    locks: Locks,
    template: NameTemplate,
    fields: list[inspect.Parameter],
    info: GuardInfo,
    timeout: float | None,
    max_hold: float | None,
    lost_retry: str | None,
    outage_retry: str,
    scope: Literal["request", "function"],
) -> Callable[..., AsyncIterator[_Hold]]:
    """The guard's dependency with ``yield``: acquire, run the request inside, release."""
    ttl, busy_status, header = info.ttl, info.busy_status, info.header
    blocking = timeout is not None
    plain = [p.name for p in fields if _is_plain(p)]
    in_response = scope == "request"  # the hold outlives the endpoint: it spans the response

    async def hold(**values: Any) -> AsyncIterator[_Hold]:
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
        state = request.scope[HOLD_KEY] = _Hold()
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
    hold.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return hold


async def current_lease(request: Request) -> Lease:
    """Dependency: the lease of the ``@guard`` on this route (``Depends(current_lease)``).

    The guard acquires before FastAPI resolves the endpoint's own parameters, so this is
    the guard's lease. Route- or app-level ``dependencies=[...]`` run before the guard and
    get an error here; outside a guarded route, ``asynclock.current_lease()`` still gives
    the innermost ``backend.lock()`` of the task.
    """
    state = request.scope.get(HOLD_KEY)
    if isinstance(state, _Hold) and state.lease is not None:
        return state.lease
    if guard_info(request.scope.get("endpoint")) is not None:
        # A guarded route, and the hold has not run: it was skipped because the lock
        # name's parameters failed validation (FastAPI is collecting those errors), or
        # this is a route-level dependency, which runs before the guard.
        raise HTTPException(
            422,
            detail="no lock was taken for this request: the lock name's parameters are "
            "invalid (or current_lease is used by a route-level dependency, which runs "
            "before the guard acquires)",
        )
    raise RuntimeError(
        f"current_lease was resolved on {request.method} {request.url.path}, which is not "
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
