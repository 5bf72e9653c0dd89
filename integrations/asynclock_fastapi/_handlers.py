"""``install(app)``: exception handlers, the response-phase middleware and OpenAPI entries."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from asynclock import (
    AcquireTimeout,
    BackendUnavailable,
    LeaseLost,
    LockHeld,
    RestartGrace,
    StaleToken,
    check_seconds,
)

from ._common import (
    CAPTURE_KEY,
    INSTALLED_KEY,
    IdempotentAnswer,
    LostDuringResponse,
    grace_unavailable,
    lock_service_unavailable,
)
from ._fence import FencingToken, fence_responses
from ._idempotency_key import SCHEMA_MARK, idempotency_responses
from ._plumbing import guard_info, responses_of

logger = logging.getLogger("asynclock_fastapi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def install(app: FastAPI, *, retry_after: float = 1.0) -> FastAPI:
    """Map asynclock's errors to HTTP answers and document them; call before the app starts.

    - ``LeaseLost`` → 503 with ``Retry-After`` (``retry_after`` seconds: the lease's own
      ttl is not on the exception; guarded routes use theirs);
    - ``LockHeld``, ``AcquireTimeout`` → 409 (``Retry-After`` when the lock says when it frees);
    - ``RestartGrace`` (the lock server lost its data a short while ago and grants nothing
      until the grace ends) → 503 with ``Retry-After`` (the seconds left of the grace);
    - ``BackendUnavailable`` → 503 with ``Retry-After`` (``retry_after`` seconds); the
      cause is logged, not sent (it names the lock server);
    - ``StaleToken`` → 412 Precondition Failed (from a fence inside the endpoint: the
      transaction rolled back or the Lua call wrote nothing);
    - a lease lost after the response started (a stream, a background task) ends the
      response incomplete with one warning in the log, never a traceback;
    - ``@locks.idempotent`` routes: their responses are held back until stored (see
      ``_idempotent``); such an app refuses to start without ``install``;
    - OpenAPI: guarded routes list their busy/503 answers and the token response header,
      routes with a ``FencingToken`` dependency their 400/412/428, idempotent routes their
      key header and 400/409/410/422/503.

    Returns ``app``.
    """
    if not isinstance(app, FastAPI):
        raise TypeError(f"install() takes a FastAPI app, not {type(app).__name__}")
    if getattr(app.state, "asynclock_fastapi_installed", False):
        raise RuntimeError("asynclock_fastapi.install() was already called on this app")
    retry_after = check_seconds(retry_after, "retry_after", zero=True)
    app.state.asynclock_fastapi_installed = True
    lost_retry = str(max(1, math.ceil(retry_after)))

    async def lease_lost(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            {"detail": f"lock lost, the request was stopped: {exc}"},
            status_code=503,
            headers={"Retry-After": lost_retry},
        )

    async def busy(request: Request, exc: Exception) -> JSONResponse:
        headers = None
        if isinstance(exc, LockHeld) and exc.retry_after is not None:
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return JSONResponse({"detail": f"busy: {exc}"}, status_code=409, headers=headers)

    async def grace(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RestartGrace)
        return _as_response(grace_unavailable(exc.retry_after, exc.until))

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        return _as_response(
            lock_service_unavailable(request.method, request.url.path, exc, lost_retry)
        )

    async def stale(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StaleToken)
        return JSONResponse(
            {"detail": str(exc), "token": exc.token, "current": exc.current}, status_code=412
        )

    app.add_exception_handler(LeaseLost, lease_lost)
    app.add_exception_handler(LockHeld, busy)
    app.add_exception_handler(AcquireTimeout, busy)
    app.add_exception_handler(RestartGrace, grace)  # a LockHeld; the most specific wins
    app.add_exception_handler(BackendUnavailable, unavailable)
    app.add_exception_handler(StaleToken, stale)
    app.add_middleware(ResponsePhase)
    _document(app)
    return app


class ResponsePhase:
    """ASGI middleware: a guard's lease lost after the endpoint returned; the responses of
    idempotent routes held back until stored.

    Nothing sent yet: answer 503. The response already started: stop it where it is, so
    the client sees an incomplete body (the server closes the connection), and log one
    warning instead of the server's traceback.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = complete = False

        async def forward(message: Message) -> None:
            nonlocal started, complete
            kind = message["type"]
            if kind == "http.response.start":
                started = True
            elif kind == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def tracked(message: Message) -> None:
            capture = scope.get(CAPTURE_KEY)
            if capture is not None and capture.active:
                # An idempotent request's response: held back until it is complete and
                # stored (see _idempotent), then sent.
                await capture.send(message, forward)
            else:
                await forward(message)

        scope[INSTALLED_KEY] = True
        try:
            await self.app(scope, receive, tracked)
        except IdempotentAnswer as exc:
            if started:
                logger.warning(
                    "%s %s: response cut short: %s", scope.get("method"), scope.get("path"), exc
                )
                return
            response = JSONResponse(
                {"detail": exc.detail},
                status_code=exc.status,
                headers={"Retry-After": exc.retry_after},
            )
            await response(scope, receive, send)
        except LostDuringResponse as exc:
            if complete:
                logger.warning(
                    "%s %s: lease lost after the response was sent (background tasks stopped): %s",
                    scope.get("method"),
                    scope.get("path"),
                    exc.lost,
                )
                return
            if started:
                logger.warning(
                    "%s %s: response cut short (the client sees an incomplete body): %s",
                    scope.get("method"),
                    scope.get("path"),
                    exc.lost,
                )
                return
            response = JSONResponse(
                {"detail": f"lock lost, the request was stopped: {exc.lost}"},
                status_code=503,
                headers={"Retry-After": str(max(1, exc.retry_after))},
            )
            await response(scope, receive, send)


def _as_response(exc: HTTPException) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _dependency_calls(dependant: Any) -> Iterator[Any]:
    for sub in getattr(dependant, "dependencies", ()):
        yield sub.call
        yield from _dependency_calls(sub)


def _document(app: FastAPI) -> None:
    """Add the guards' and fences' answers to the OpenAPI schema when it is first built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for route in app.routes:
                if not isinstance(route, APIRoute):
                    continue
                info = guard_info(route.endpoint)
                if info is not None:
                    _add_responses(route, responses_of(info))
                fences = [
                    c for c in _dependency_calls(route.dependant) if isinstance(c, FencingToken)
                ]
                for fence in fences[:1]:
                    _add_responses(route, fence_responses(fence.header))
            schema = build()
            _add_token_headers(app, schema)
            _add_idempotency_answers(schema)
            return schema
        return build()

    app.openapi = openapi  # type: ignore[method-assign]


def _add_responses(route: APIRoute, responses: dict[int | str, dict[str, Any]]) -> None:
    """Add what the route does not document itself (by status, ``409`` or ``"409"``).

    A new dict: routes may share the one they were given.
    """
    known = {str(code) for code in route.responses}
    extra = {code: doc for code, doc in responses.items() if str(code) not in known}
    if extra:
        route.responses = {**route.responses, **extra}


def _add_token_headers(app: FastAPI, schema: dict[str, Any]) -> None:
    """Fenced operations list their token header; guarded ones their response header."""
    paths = schema.get("paths", {})
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        fences = [c for c in _dependency_calls(route.dependant) if isinstance(c, FencingToken)]
        for fence in fences[:1]:
            for method in route.methods or ():
                operation = paths.get(route.path_format, {}).get(method.lower())
                if operation is not None:
                    parameters = operation.setdefault("parameters", [])
                    if not any(p.get("name") == fence.header for p in parameters):
                        parameters.append(fence.openapi_parameter())
        info = guard_info(route.endpoint)
        if info is None or info.header is None:
            continue
        for method in route.methods or ():
            operation = paths.get(route.path_format, {}).get(method.lower())
            if operation is None:
                continue
            for code, response in operation.get("responses", {}).items():
                if str(code).startswith("2"):
                    response.setdefault("headers", {})[info.header] = {
                        "description": "the fencing token of the lease the request held; "
                        "forward it to fenced services",
                        "schema": {"type": "integer"},
                    }


def _add_idempotency_answers(schema: dict[str, Any]) -> None:
    """Operations with an idempotency key header (``@locks.idempotent``, found by the mark
    on the header's schema, so routes of included routers too): the header required or
    not, and the draft's answers 400, 409, 422, plus 410 and 503."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            if not isinstance(operation, dict):
                continue
            for parameter in operation.get("parameters", ()):
                param_schema = parameter.get("schema", {})
                if SCHEMA_MARK not in param_schema:
                    continue
                required = bool(param_schema.pop(SCHEMA_MARK))
                # FastAPI declares it optional, so that a missing key gets the draft's 400
                # (not its validation 422); the document says what the route requires.
                parameter["required"] = required
                if required:
                    param_schema.pop("anyOf", None)
                    param_schema["type"] = "string"
                    param_schema.pop("default", None)
                responses = operation.setdefault("responses", {})
                for code, doc in idempotency_responses(parameter["name"]).items():
                    if code in responses:
                        responses[code]["description"] += f"; or {doc['description']}"
                    else:
                        responses[code] = doc
