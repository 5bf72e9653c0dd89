"""``@locks.idempotent(ttl=...)``: the ``Idempotency-Key`` header (IETF draft) on a route.

How a request runs (each step tested in ``tests/integrations/test_fastapi_idempotent.py``):

1. The endpoint's first parameter is a *key dependency* with ``yield`` (request scope, so
   FastAPI keeps it open while the response is sent). It reads the header (400 when a
   required one is missing or malformed), the request body (FastAPI has read it already),
   and enters ``backend.idempotent(...)`` with the key scoped by method, route and
   ``identity``, and a fingerprint of method, path, query and body bytes.
2. A replay: the endpoint is not called; the wrapper returns the stored response (status,
   body bytes, kept headers, ``Idempotent-Replayed: true``). Key reused with another payload:
   422; another request with the key still running: 409 with ``Retry-After``; the lock
   server unreachable: 503.
3. A first run: the endpoint runs inside the key's lease (its loss cancels it). An
   exception the app has a handler for (``HTTPException``...) is answered by that handler
   here, so a 4xx is the route's outcome like any response. The response is *captured* by
   the middleware that :func:`~asynclock_fastapi.install` adds (``ResponsePhase``): its
   messages are held back until complete, then stored with ``op.save()`` (fenced by the
   lease's token) and only then sent. Background tasks run after that, still in the lease.
4. Not stored: 5xx and 408/409/425/429 (the key is freed: a retry runs), an exception
   without a handler (freed). Too large (the core's 64 KiB): the response goes out once
   and a marker is stored: a replay answers 410 Gone.

Why not around the route's ASGI app (as ``_route`` holds a guard): routes of an included
``APIRouter`` are served by FastAPI's include context, not by the route objects the app
lists, so a wrapper there would miss them; the endpoint and its dependencies are reached
the same way on every route.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Header, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

import asynclock
from asynclock import (
    AsynclockError,
    BackendUnavailable,
    IdempotencyKeyReused,
    InProgress,
    LeaseLost,
    RestartGrace,
    StaleToken,
)

from ._common import (
    CAPTURE_KEY,
    INSTALLED_KEY,
    F,
    IdempotentAnswer,
    _retry_after,
    check_header_name,
    grace_unavailable,
)
from ._route import _param_of

if TYPE_CHECKING:
    from ._locks import Locks

logger = logging.getLogger("asynclock_fastapi")
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

#: Attribute on an idempotent endpoint: its :class:`IdempotencyInfo` (OpenAPI, tools).
IDEMPOTENT_ATTR = "__asynclock_idempotent__"
#: The key dependency's parameter, put first in an idempotent endpoint's signature.
_KEY_PARAM = "asynclock_fastapi_idempotency_"
_REQUEST_PARAM = "asynclock_fastapi_idempotency_request_"
#: Marker in the header parameter's schema: ``install`` documents the operation's answers.
SCHEMA_MARK = "x-asynclock-idempotency"
#: Statuses never stored (the draft's "try again" answers and every 5xx): the key is freed.
UNSTORED = frozenset({408, 409, 425, 429})
#: Methods that are safe by definition: their requests pass through (a key is ignored).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
MAX_KEY_CHARS = 255
#: The core's bounds for ``keep`` (docs/idempotency.md), checked when the route is declared.
MIN_KEEP, MAX_KEEP = 1.0, 30 * 86400.0
_ALLOWED_KEY = (
    f"a structured-field string of 1 to {MAX_KEY_CHARS} characters: printable ASCII in "
    'double quotes, \\" and \\\\ escaped (e.g. "8e03978e-40d5"); a bare value of visible '
    "ASCII without quotes or backslashes is taken as it is"
)


class IdempotencyInfo:
    """What ``@locks.idempotent`` does on a route, for OpenAPI and tools."""

    __slots__ = ("header", "keep", "replay_header", "required", "ttl", "wait")

    def __init__(
        self, header: str, replay_header: str, required: bool, ttl: float, keep: float, wait: float
    ) -> None:
        self.header = header
        self.replay_header = replay_header
        self.required = required
        self.ttl = ttl
        self.keep = keep
        self.wait = wait


def parse_key(raw: str) -> str:
    """The key in an ``Idempotency-Key`` header value, or ValueError saying what is allowed.

    The draft makes the value an RFC 8941 structured-field string (``"..."``); clients
    that send the bare key (Stripe's SDKs) are common, so a bare value of visible ASCII
    without quotes or backslashes is taken as it is.
    """
    if len(raw) >= 2 and raw[0] == '"' and raw[-1] == '"':
        chars: list[str] = []
        escaped = False
        for c in raw[1:-1]:
            if escaped:
                if c not in '"\\':
                    raise ValueError(f"\\{c} is not an escape; allowed: {_ALLOWED_KEY}")
                chars.append(c)
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"' or not " " <= c <= "~":
                raise ValueError(f"{c!r} may not appear unescaped; allowed: {_ALLOWED_KEY}")
            else:
                chars.append(c)
        if escaped:
            raise ValueError(f"the value ends inside an escape; allowed: {_ALLOWED_KEY}")
        key = "".join(chars)
    else:
        bad = next((c for c in raw if c in '"\\' or not "!" <= c <= "~"), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not allowed in a bare key; allowed: {_ALLOWED_KEY}")
        key = raw
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise ValueError(f"the key is {len(key)} characters long; allowed: {_ALLOWED_KEY}")
    return key


class Capture:
    """One response held back by ``ResponsePhase`` until it is complete and stored.

    ``on_complete`` (the key dependency's) is awaited with the whole response before any
    of it is sent; if it raises, nothing was sent and the error answers instead. If it
    calls :meth:`hold`, the response waits for :meth:`flush` (an answer not stored goes
    out once its key is free, so a retry sent when it arrives runs).
    """

    __slots__ = ("_forward", "_hold", "active", "messages", "on_complete")

    def __init__(self, on_complete: Callable[[Capture], Awaitable[None]]) -> None:
        self.active = True
        self.messages: list[Message] = []
        self.on_complete = on_complete
        self._hold = False
        self._forward: Send | None = None

    def hold(self) -> None:
        """Keep the complete response until :meth:`flush` (called from ``on_complete``)."""
        self._hold = True

    async def flush(self) -> None:
        """Send a response :meth:`hold` kept (nothing if there is none)."""
        forward, self._forward = self._forward, None
        held, self.messages = self.messages, []
        if forward is not None:
            for m in held:
                await forward(m)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(bytes(n), bytes(v)) for n, v in self.messages[0].get("headers", ())]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    async def send(self, message: Message, forward: Send) -> None:
        kind = message["type"]
        if kind not in ("http.response.start", "http.response.body") or message.get("trailers"):
            # A file sent by path, trailers: not a response this can keep. It goes out as
            # it is, and nothing is stored (the key is freed when the request ends).
            self.active = False
            held, self.messages = self.messages, []
            for m in held:
                await forward(m)
            await forward(message)
            return
        self.messages.append(message)
        if kind == "http.response.body" and not message.get("more_body", False):
            self.active = False
            await self.on_complete(self)  # may raise: then nothing was sent
            if self._hold:
                self._forward = forward
                return
            for m in self.messages:
                await forward(m)

    def discard(self) -> None:
        self.active = False
        self.messages = []
        self._forward = None


class _KeyState:
    """One idempotent request's state, shared by the key dependency and the endpoint wrapper."""

    __slots__ = ("replay", "stored")

    def __init__(self) -> None:
        #: The response to send instead of running the endpoint (a replay, or 410).
        self.replay: Response | None = None
        #: The complete response was stored (or marked too large).
        self.stored = False


class _Free(Exception):
    """Raised inside ``backend.idempotent`` to free the key (nothing stored): a retry runs."""


def _replay_response(result: object, replay_header: str) -> Response:
    """The stored response of ``result`` (see ``_stored``), or 410 for one too large."""
    if isinstance(result, dict) and result.get("v") == 1 and "body" in result:
        response = Response(
            content=base64.b64decode(result["body"]), status_code=int(result["status"])
        )
        # Raw, so a header sent twice (Set-Cookie, Link) is replayed twice.
        response.raw_headers.extend(
            (str(n).encode("latin-1"), str(v).encode("latin-1"))
            for n, v in result.get("headers", ())
        )
        response.raw_headers.append((replay_header.lower().encode("latin-1"), b"true"))
        return response
    status = result.get("status") if isinstance(result, dict) else None
    return Response(
        content=json.dumps(
            {
                "detail": "the request with this Idempotency-Key was processed, but its "
                "response was too large to keep, so it cannot be replayed; do not retry it "
                "(send a new key for a new request)",
                "status": status,
            }
        ).encode(),
        status_code=410,
        media_type="application/json",
        headers={replay_header: "true"},
    )


async def _render(request: Request, exc: Exception) -> Response | None:
    """The response the app's handler for ``exc`` makes (``HTTPException``, a validation
    error, your own), or None if it has none. asynclock's own errors are not the route's
    outcome (a lost lease, the lock server gone): they are never rendered here."""
    if isinstance(exc, AsynclockError):
        return None
    handlers = request.scope.get("starlette.exception_handlers")
    if not handlers:
        return None
    exception_handlers, status_handlers = handlers
    handler = None
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        handler = status_handlers.get(status)
    if handler is None:
        for cls in type(exc).__mro__[:-2]:  # not Exception, BaseException: the server's 500
            if cls in exception_handlers:
                handler = exception_handlers[cls]
                break
    if handler is None:
        return None  # an unexpected error: the server's 500, and the key is freed
    if inspect.iscoroutinefunction(handler):
        response = await handler(request, exc)
    else:
        response = await run_in_threadpool(handler, request, exc)
    return response if isinstance(response, Response) else None


def make_idempotent(
    locks: Locks,
    *,
    ttl: float,
    keep: float,
    required: bool,
    header: str,
    replay_header: str,
    identity: Callable[[Request], str | Awaitable[str]] | None,
    wait: float,
    retry_after: float,
    keep_headers: Sequence[str],
) -> Callable[[F], F]:
    """:meth:`Locks.idempotent` (see there), options checked."""
    ttl = locks._check_lease_ttl(ttl)
    keep = asynclock.check_seconds(keep, "keep")
    if not MIN_KEEP <= keep <= MAX_KEEP:
        raise ValueError(f"keep must be between 1 second and 30 days (2592000 s), got {keep!r}")
    wait = asynclock.check_seconds(wait, "wait", zero=True)
    retry = _retry_after(asynclock.check_seconds(retry_after, "retry_after", zero=True)) or "1"
    header = check_header_name(header, "header")
    replay_header = check_header_name(replay_header, "replay_header")
    if not isinstance(required, bool):
        raise TypeError(f"required must be a bool, got {required!r}")
    if identity is not None and not callable(identity):
        raise TypeError(f"identity must be a callable taking the Request, got {identity!r}")
    if isinstance(keep_headers, str):
        raise TypeError(f"keep_headers must be a sequence of header names, got {keep_headers!r}")
    kept = {check_header_name(h, "keep_headers").lower().encode() for h in keep_headers}
    kept.add(b"content-type")
    info = IdempotencyInfo(header, replay_header, required, ttl, keep, wait)
    lost_retry = _retry_after(ttl) or "1"
    header_param = Header(
        alias=header,
        description="The request's idempotency key (IETF draft 'The Idempotency-Key HTTP "
        "Header Field'): a retry with the same key and the same request gets the first "
        f"answer instead of running again. {_ALLOWED_KEY[0].upper()}{_ALLOWED_KEY[1:]}.",
        json_schema_extra={SCHEMA_MARK: required},
    )

    def decorate(endpoint: F) -> F:
        what = getattr(endpoint, "__qualname__", repr(endpoint))
        if not inspect.iscoroutinefunction(endpoint):
            raise TypeError(
                f"@idempotent needs an `async def` endpoint, and {what} is not one: a sync "
                "endpoint runs in a worker thread that a lost lease cannot interrupt"
            )
        if hasattr(endpoint, IDEMPOTENT_ATTR):
            raise TypeError(f"{what} is made idempotent twice; use one @idempotent")
        signature = inspect.signature(endpoint)
        if _KEY_PARAM in signature.parameters:
            raise TypeError(f"an endpoint parameter may not be named {_KEY_PARAM!r}")
        if any(
            p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.POSITIONAL_ONLY)
            for p in signature.parameters.values()
        ):
            raise TypeError(
                f"{what}: an idempotent endpoint takes named parameters only (FastAPI passes "
                "every value by name), not *args, **kwargs or /"
            )
        operation = f"{getattr(endpoint, '__module__', '')}.{what}"
        # FastAPI passes the request to one parameter only: the endpoint's own if it has one.
        own_request = _param_of(signature, Request)
        request_key = own_request or _REQUEST_PARAM

        async def key_dependency(
            request: Request, raw: str | None = None
        ) -> AsyncIterator[_KeyState]:
            state = _KeyState()
            if not request.scope.get(INSTALLED_KEY):
                raise RuntimeError(
                    "@locks.idempotent needs the middleware install(app) adds: call "
                    "asynclock_fastapi.install(app) before the app starts"
                )
            if request.method in SAFE_METHODS:
                yield state  # a safe method is idempotent by itself
                return
            if raw is None:
                if required:
                    raise HTTPException(
                        400,
                        detail=f"this request needs an {header} header: {_ALLOWED_KEY}",
                    )
                yield state
                return
            try:
                key = parse_key(raw)
            except ValueError as exc:
                raise HTTPException(400, detail=f"invalid {header} header: {exc}") from None
            who = ""
            if identity is not None:
                found = identity(request)
                if inspect.isawaitable(found):
                    found = await found
                who = "" if found is None else str(found)
            route = request.scope.get("route")
            template = f"{request.scope.get('root_path', '')}{getattr(route, 'path_format', '')}"
            scoped = json.dumps([request.method, template, operation, who, key])
            name = "http:" + hashlib.sha256(scoped.encode()).hexdigest()
            fingerprint = hashlib.sha256()
            for part in (request.method, request.url.path, request.url.query):
                fingerprint.update(part.encode("utf-8", "surrogateescape") + b"\x00")
            fingerprint.update(await _body_of(request))
            try:
                async with locks.backend.idempotent(
                    name,
                    ttl=ttl,
                    fingerprint=fingerprint.hexdigest(),
                    keep=keep,
                    wait=wait if wait > 0 else None,
                ) as op:
                    if op.replayed:
                        state.replay = _replay_response(op.result, replay_header)
                        yield state
                        return

                    async def store(capture: Capture) -> None:
                        status = capture.status
                        if status >= 500 or status in UNSTORED:
                            # Freed below, when the request's dependencies end (after
                            # the response and its background tasks, in FastAPI); the
                            # answer waits for it, so a retry sent on it runs (not 409).
                            capture.hold()
                            return
                        headers = [
                            [n.decode("latin-1"), v.decode("latin-1")]
                            for n, v in capture.headers
                            if n.lower() in kept
                        ]
                        record = {
                            "v": 1,
                            "status": status,
                            "headers": headers,
                            "body": base64.b64encode(capture.body).decode("ascii"),
                        }
                        try:
                            await op.save(record)
                        except ValueError:
                            # Larger than the core keeps: this response goes out once, and a
                            # replay says so (410) instead of running the request again.
                            await op.save({"v": 1, "too_large": True, "status": status})
                        state.stored = True

                    capture = request.scope[CAPTURE_KEY] = Capture(store)
                    try:
                        yield state
                    except BaseException:
                        capture.discard()
                        raise
                    finally:
                        request.scope[CAPTURE_KEY] = None
                    if not state.stored:
                        raise _Free
            except _Free:
                await capture.flush()  # the key is free: the answer not stored goes out
            except IdempotencyKeyReused:
                raise HTTPException(
                    422,
                    detail=f"this {header} was used with a different request (method, path, "
                    "query or body); send a new key for a new request",
                ) from None
            except InProgress:
                raise HTTPException(
                    409,
                    detail=f"a request with this {header} is still being processed; retry "
                    f"in {retry}s to get its answer",
                    headers={"Retry-After": retry},
                ) from None
            except RestartGrace as exc:
                raise grace_unavailable(exc.retry_after, exc.until) from None
            except BackendUnavailable as exc:
                logger.warning("%s %s: lock server unavailable: %s", request.method, name, exc)
                raise IdempotentAnswer(
                    503,
                    "the lock server is unavailable, so the request was not run; retry later",
                    retry,
                ) from None
            except (LeaseLost, StaleToken) as exc:
                # StaleToken: the fenced save was refused (the lease is no longer live at
                # the server); the core counts the lease as lost.
                logger.warning(
                    "idempotent request %s %s stopped: %s", request.method, request.url.path, exc
                )
                raise IdempotentAnswer(
                    503,
                    f"the lease of the {header} was lost, the request was stopped and its "
                    "answer not kept; retry with the same key",
                    lost_retry,
                ) from None

        key_dependency.__qualname__ = f"idempotency_key_of_{what}"
        # Given as objects, not annotations (this module's annotations are strings, and the
        # header's name is this decorator's): FastAPI documents the header from it.
        key_dependency.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
                inspect.Parameter(
                    "raw",
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=Annotated[str | None, header_param],
                    default=None,
                ),
            ]
        )
        key_depends = Depends(key_dependency, scope="request")

        @functools.wraps(endpoint)
        async def idempotent(*args: Any, **kwargs: Any) -> Any:
            state: _KeyState = kwargs.pop(_KEY_PARAM)
            if state.replay is not None:
                return state.replay
            request: Request = kwargs[request_key] if own_request else kwargs.pop(request_key)
            try:
                return await endpoint(*args, **kwargs)
            except Exception as exc:
                # The route's outcome as the app would answer it: answered (and stored) here.
                response = await _render(request, exc)
                if response is None:
                    raise
                return response

        params = [p.replace(kind=p.KEYWORD_ONLY) for p in signature.parameters.values()]
        hidden = [
            inspect.Parameter(_KEY_PARAM, inspect.Parameter.KEYWORD_ONLY, default=key_depends)
        ]
        if own_request is None:
            hidden.append(
                inspect.Parameter(
                    _REQUEST_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Request
                )
            )
        idempotent.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*hidden, *params]
        )
        setattr(idempotent, IDEMPOTENT_ATTR, info)
        return idempotent  # type: ignore[return-value]

    return decorate


async def _body_of(request: Request) -> bytes:
    """The request body's bytes, as FastAPI read them; a form FastAPI parsed already (its
    stream is consumed) by its fields: names, values, and each upload's name, type and a
    SHA-256 of its contents (so a multipart body's boundary, which a client picks anew for
    each request, is not part of it, and another file is)."""
    try:
        return await request.body()
    except RuntimeError:
        form = await request.form()
        parts: list[list[str | int | None]] = []
        for field, value in form.multi_items():
            if isinstance(value, str):
                parts.append([field, value])
                continue
            digest = hashlib.sha256()
            await value.seek(0)
            while chunk := await value.read(1 << 16):
                digest.update(chunk)
            await value.seek(0)  # the endpoint reads it from the start
            parts.append([field, value.filename, value.content_type, digest.hexdigest()])
        return json.dumps(parts).encode()


def idempotency_responses(header: str) -> dict[str, dict[str, Any]]:
    """The OpenAPI answers of an idempotent operation (the draft's, and this library's)."""
    retry = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    return {
        "400": {"description": f"The {header} header is missing (where required) or malformed"},
        "409": {
            "description": f"A request with this {header} is still being processed; retry "
            "after Retry-After seconds to get its answer",
            "headers": retry,
        },
        "410": {
            "description": f"The request with this {header} was processed, but its response "
            "was too large to keep and cannot be replayed"
        },
        "422": {
            "description": f"This {header} was used with a different request (method, path, "
            "query or body)"
        },
        "503": {
            "description": "The lock server cannot be reached, or the key's lease was lost "
            "while the request ran; retry after Retry-After seconds",
            "headers": retry,
        },
    }


def idempotency_info(endpoint: object) -> IdempotencyInfo | None:
    """The :class:`IdempotencyInfo` of an idempotent endpoint, else None."""
    info = getattr(endpoint, IDEMPOTENT_ATTR, None)
    return info if isinstance(info, IdempotencyInfo) else None
