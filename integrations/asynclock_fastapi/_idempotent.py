"""``@locks.idempotent(ttl=...)``: the ``Idempotency-Key`` header (IETF draft) on a route.

How a request runs (each step a method of :class:`IdempotentEndpoint`, each tested in
``tests/integrations/test_fastapi_idempotent.py``):

1. The endpoint's first parameter is a *key dependency* with ``yield`` (request scope, so
   FastAPI keeps it open while the response is sent). It reads the header (400 when a
   required one is missing or malformed, or sent twice), the request body (FastAPI has read
   it already), and enters ``backend.idempotent(...)`` with the key scoped by method, route
   and ``identity``, and a fingerprint of method, path, query and body (a JSON body by its
   value: ``_capture.body_of``).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Header, HTTPException, Request, Response

import asynclock
from asynclock import (
    BackendUnavailable,
    IdempotencyKeyReused,
    InProgress,
    LeaseLost,
    RestartGrace,
    StaleToken,
)
from asynclock.idempotency import check_keep

from ._capture import Capture, body_of, render, replay_response
from ._common import (
    CAPTURE_KEY,
    INSTALLED_KEY,
    F,
    IdempotentAnswer,
    _retry_after,
    check_header_name,
    grace_unavailable,
)
from ._idempotency_key import (
    _ALLOWED_KEY,
    IDEMPOTENT_ATTR,
    SCHEMA_MARK,
    IdempotencyInfo,
    parse_key,
)
from ._plumbing import _typed_signature
from ._route import _param_of

if TYPE_CHECKING:
    from ._locks import Locks

logger = logging.getLogger("asynclock_fastapi")

#: The key dependency's parameter, put first in an idempotent endpoint's signature.
_KEY_PARAM = "asynclock_fastapi_idempotency_"
_REQUEST_PARAM = "asynclock_fastapi_idempotency_request_"
#: Statuses never stored (the draft's "try again" answers and every 5xx): the key is freed.
UNSTORED = frozenset({408, 409, 425, 429})
#: Methods that are safe by definition: their requests pass through (a key is ignored).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


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


#: What the key dependency answers itself (:meth:`IdempotentEndpoint.answer`); anything
#: else the endpoint raised goes on to the app's handlers.
_ANSWERED = (
    IdempotencyKeyReused,
    InProgress,
    RestartGrace,
    BackendUnavailable,
    LeaseLost,
    StaleToken,
)


class Options:
    """``@locks.idempotent(...)``'s options, checked once for every endpoint it decorates."""

    def __init__(
        self,
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
    ) -> None:
        self.locks = locks
        self.ttl = locks._check_lease_ttl(ttl)
        self.keep = check_keep(keep)
        self.wait = asynclock.check_seconds(wait, "wait", zero=True)
        self.retry = (
            _retry_after(asynclock.check_seconds(retry_after, "retry_after", zero=True)) or "1"
        )
        self.header = check_header_name(header, "header")
        self.replay_header = check_header_name(replay_header, "replay_header")
        if not isinstance(required, bool):
            raise TypeError(f"required must be a bool, got {required!r}")
        self.required = required
        if identity is not None and not callable(identity):
            raise TypeError(f"identity must be a callable taking the Request, got {identity!r}")
        self.identity = identity
        if isinstance(keep_headers, str):
            raise TypeError(
                f"keep_headers must be a sequence of header names, got {keep_headers!r}"
            )
        self.kept = {check_header_name(h, "keep_headers").lower().encode() for h in keep_headers}
        self.kept.add(b"content-type")
        self.info = IdempotencyInfo(
            self.header, self.replay_header, required, self.ttl, self.keep, self.wait
        )
        self.lost_retry = _retry_after(self.ttl) or "1"
        self.header_param = Header(
            alias=self.header,
            description="The request's idempotency key (IETF draft 'The Idempotency-Key HTTP "
            "Header Field'): a retry with the same key and the same request gets the first "
            f"answer instead of running again. {_ALLOWED_KEY[0].upper()}{_ALLOWED_KEY[1:]}.",
            json_schema_extra={SCHEMA_MARK: required},
        )


class IdempotentEndpoint:
    """One endpoint under ``@locks.idempotent``: :meth:`keyed` is its key dependency's body,
    :meth:`wrapper` the endpoint FastAPI calls."""

    def __init__(self, options: Options, endpoint: Callable[..., Awaitable[Any]]) -> None:
        self.options = options
        self.endpoint = endpoint
        self.what = what = getattr(endpoint, "__qualname__", repr(endpoint))
        if not inspect.iscoroutinefunction(endpoint):
            raise TypeError(
                f"@idempotent needs an `async def` endpoint, and {what} is not one: a sync "
                "endpoint runs in a worker thread that a lost lease cannot interrupt"
            )
        if hasattr(endpoint, IDEMPOTENT_ATTR):
            raise TypeError(f"{what} is made idempotent twice; use one @idempotent")
        # Annotations evaluated (``from __future__ import annotations``): the request's
        # parameter is found by its type.
        self.signature = signature = _typed_signature(endpoint)
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
        self.operation = f"{getattr(endpoint, '__module__', '')}.{what}"
        # FastAPI passes the request to one parameter only: the endpoint's own if it has one.
        self.own_request = _param_of(signature, Request)

    # -- the key dependency --------------------------------------------------------------------

    @asynccontextmanager
    async def keyed(self, request: Request, raw: str | None) -> AsyncIterator[_KeyState]:
        """The request's key held around the endpoint and its response (or its replay)."""
        state = _KeyState()
        key = self.key_of(request, raw)
        if key is None:
            yield state  # a safe method, or no key where none is required: no idempotency
            return
        name = await self.name_of(request, key)
        options = self.options
        capture: Capture | None = None
        try:
            async with options.locks.backend.idempotent(
                name,
                ttl=options.ttl,
                fingerprint=await self.fingerprint_of(request),
                keep=options.keep,
                wait=options.wait if options.wait > 0 else None,
            ) as op:
                if op.replayed:
                    state.replay = replay_response(op.result, options.replay_header)
                    yield state
                    return
                capture = request.scope[CAPTURE_KEY] = Capture(
                    functools.partial(self.store, op, state)
                )
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
            assert capture is not None
            await capture.flush()  # the key is free: the answer not stored goes out
        except _ANSWERED as exc:
            raise self.answer(request, name, exc) from None

    def key_of(self, request: Request, raw: str | None) -> str | None:
        """The request's key; None: the request runs without one. 400 for a missing (where
        required), malformed or repeated header."""
        if not request.scope.get(INSTALLED_KEY):
            raise RuntimeError(
                "@locks.idempotent needs the middleware install(app) adds: call "
                "asynclock_fastapi.install(app) before the app starts"
            )
        if request.method in SAFE_METHODS:
            return None  # a safe method is idempotent by itself
        header = self.options.header
        if raw is None:
            if self.options.required:
                raise HTTPException(
                    400, detail=f"this request needs an {header} header: {_ALLOWED_KEY}"
                )
            return None
        if len(request.headers.getlist(header)) > 1:
            # Its value is one structured-field string: two lines are two keys, as two
            # values on one line are (which parse_key refuses).
            raise HTTPException(
                400, detail=f"invalid {header} header: sent more than once; send it once"
            )
        try:
            return parse_key(raw)
        except ValueError as exc:
            raise HTTPException(400, detail=f"invalid {header} header: {exc}") from None

    async def name_of(self, request: Request, key: str) -> str:
        """The idempotency key in the lock server: the client's key scoped by method, route,
        endpoint and ``identity``, hashed."""
        who = ""
        identity = self.options.identity
        if identity is not None:
            found = identity(request)
            if inspect.isawaitable(found):
                found = await found
            who = "" if found is None else str(found)
        route = request.scope.get("route")
        template = f"{request.scope.get('root_path', '')}{getattr(route, 'path_format', '')}"
        scoped = json.dumps([request.method, template, self.operation, who, key])
        return "http:" + hashlib.sha256(scoped.encode()).hexdigest()

    async def fingerprint_of(self, request: Request) -> str:
        """A sha256 of method, path, query and body (a JSON body by its value)."""
        fingerprint = hashlib.sha256()
        for part in (request.method, request.url.path, request.url.query):
            fingerprint.update(part.encode("utf-8", "surrogateescape") + b"\x00")
        fingerprint.update(await body_of(request))
        return fingerprint.hexdigest()

    async def store(self, op: asynclock.IdempotentCall, state: _KeyState, capture: Capture) -> None:
        """The complete response, before any of it is sent: stored, or held until its key
        is freed (a status never stored)."""
        status = capture.status
        if status >= 500 or status in UNSTORED:
            # Freed below, when the request's dependencies end (after the response and its
            # background tasks, in FastAPI); the answer waits for it, so a retry sent on it
            # runs (not 409).
            capture.hold()
            return
        kept = self.options.kept
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
            # Larger than the core keeps: this response goes out once, and a replay says so
            # (410) instead of running the request again.
            await op.save({"v": 1, "too_large": True, "status": status})
        state.stored = True

    def answer(self, request: Request, name: str, exc: Exception) -> Exception:
        """What the client gets when the key could not be held or kept (``exc`` is one of
        ``_ANSWERED``)."""
        header, retry = self.options.header, self.options.retry
        if isinstance(exc, IdempotencyKeyReused):
            return HTTPException(
                422,
                detail=f"this {header} was used with a different request (method, path, "
                "query or body); send a new key for a new request",
            )
        if isinstance(exc, InProgress):
            return HTTPException(
                409,
                detail=f"a request with this {header} is still being processed; retry in "
                f"{retry}s to get its answer",
                headers={"Retry-After": retry},
            )
        if isinstance(exc, RestartGrace):
            return grace_unavailable(exc.retry_after, exc.until)
        if isinstance(exc, BackendUnavailable):
            logger.warning("%s %s: lock server unavailable: %s", request.method, name, exc)
            return IdempotentAnswer(
                503,
                "the lock server is unavailable, so the request was not run; retry later",
                retry,
            )
        # LeaseLost, or StaleToken: the fenced save was refused (the lease is no longer
        # live at the server); the core counts the lease as lost.
        logger.warning(
            "idempotent request %s %s stopped: %s", request.method, request.url.path, exc
        )
        return IdempotentAnswer(
            503,
            f"the lease of the {header} was lost, the request was stopped and its answer "
            "not kept; retry with the same key",
            self.options.lost_retry,
        )

    def dependency(self) -> Any:
        """The key dependency, as FastAPI sees it: ``Depends`` of a function of the request
        and the header (given as objects, not annotations: this module's annotations are
        strings, and the header's name is the decorator's)."""

        async def key_dependency(
            request: Request, raw: str | None = None
        ) -> AsyncIterator[_KeyState]:
            async with self.keyed(request, raw) as state:
                yield state

        key_dependency.__qualname__ = f"idempotency_key_of_{self.what}"
        key_dependency.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request),
                inspect.Parameter(
                    "raw",
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=Annotated[str | None, self.options.header_param],
                    default=None,
                ),
            ]
        )
        return Depends(key_dependency, scope="request")

    # -- the endpoint --------------------------------------------------------------------------

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        """The endpoint, or the replay; an exception the app has a handler for is answered
        (and stored) here, as the route's outcome."""
        state: _KeyState = kwargs.pop(_KEY_PARAM)
        if state.replay is not None:
            return state.replay
        own = self.own_request
        request: Request = kwargs[own] if own else kwargs.pop(_REQUEST_PARAM)
        try:
            return await self.endpoint(*args, **kwargs)
        except Exception as exc:
            response = await render(request, exc)
            if response is None:
                raise
            return response

    def wrapper(self) -> Any:
        """The function FastAPI routes to: :meth:`call` with the endpoint's signature, the
        key dependency (and the request, unless the endpoint takes it) in front."""

        @functools.wraps(self.endpoint)
        async def idempotent(*args: Any, **kwargs: Any) -> Any:
            return await self.call(*args, **kwargs)

        params = [p.replace(kind=p.KEYWORD_ONLY) for p in self.signature.parameters.values()]
        hidden = [
            inspect.Parameter(_KEY_PARAM, inspect.Parameter.KEYWORD_ONLY, default=self.dependency())
        ]
        if self.own_request is None:
            hidden.append(
                inspect.Parameter(
                    _REQUEST_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Request
                )
            )
        idempotent.__signature__ = self.signature.replace(  # type: ignore[attr-defined]
            parameters=[*hidden, *params]
        )
        setattr(idempotent, IDEMPOTENT_ATTR, self.options.info)
        return idempotent


def make_idempotent(locks: Locks, **options: Any) -> Callable[[F], F]:
    """:meth:`Locks.idempotent` (see there), options checked."""
    checked = Options(locks, **options)

    def decorate(endpoint: F) -> F:
        return IdempotentEndpoint(checked, endpoint).wrapper()  # type: ignore[no-any-return]

    return decorate
