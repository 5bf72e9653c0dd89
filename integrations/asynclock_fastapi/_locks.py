"""The holder side: ``Locks`` opens a backend in the lifespan; ``guard`` holds a lease per request.

Where the route allows it, ``Locks.lifespan(app)`` holds a guard's lease around the route's
ASGI app instead (see ``_route``: the same promises without the cost of a dependency with
``yield``). Elsewhere, how a guarded request runs (the timing the docs promise, each point
tested):

1. FastAPI resolves the endpoint's dependencies in parameter order. The guard puts its own
   *lock dependency* (a dependency with ``yield``) first, so the lease is acquired before
   any other dependency of the endpoint's own parameters, ``guard_lease`` included.
2. The lock dependency enters ``async with backend.lock(...)``: the rest of the request
   runs inside the lock's cancel scope. A lost lease cancels whatever runs then (the
   endpoint, a dependency, the streaming body, a background task), the ``async with``
   raises ``LeaseLost``, and the lock dependency turns it into a 503 with ``Retry-After``
   (or, once the response has started, ends it quietly; see ``_handlers``).
3. The lease is released when FastAPI exits the lock dependency: with the default scope
   (``release="response"``) after the response is sent *and* its background tasks ran;
   with ``release="endpoint"`` (FastAPI's ``Depends(scope="function")``) as soon as the
   endpoint returns, before the response is sent.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Depends, Response

import asynclock
from asynclock import (
    Backend,
    Lease,
    NameTemplate,
)
from asynclock.idempotency import DEFAULT_KEEP

from ._common import (
    _LOCK_PARAM,
    DEFAULT_HEADER,
    GUARD_ATTR,
    F,
    GuardInfo,
    Lifespan,
    _GuardState,
    _retry_after,
    check_header_name,
)
from ._plumbing import (
    Answers,
    _depend_on,
    _is_guard_lease,
    _is_plain,
    _make_lock_dependency,
    _typed_signature,
)
from ._route import ROUTE_ATTR, RouteGuard, twin_endpoint, wrap_routes

if TYPE_CHECKING:
    from fastapi import Request

logger = logging.getLogger("asynclock_fastapi")


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
        #: Routes made idempotent with this Locks (the lifespan checks install()).
        self._idempotent = 0

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
        :meth:`wrap` combine the two. Pass the app: the guards of its routes are then held
        around the routes where they can be (cheaper; the docs say which routes).
        """
        if self._backend is not None:
            raise RuntimeError("this Locks is already open (one lifespan at a time)")
        if self._idempotent and app is not None:
            state = getattr(app, "state", None)
            if not getattr(state, "asynclock_fastapi_installed", False):
                raise RuntimeError(
                    "@locks.idempotent routes need asynclock_fastapi.install(app) (its "
                    "middleware keeps their responses): call it before the app starts"
                )
        backend = self._given if self._given is not None else self._connect()
        async with backend:
            self._backend = backend
            wrapped = []
            try:
                # The guards of the app's routes held around the routes where they can be
                # (see _route): the same promises, without the cost of a yield dependency.
                wrapped = wrap_routes(app, self)
                yield
            finally:
                for route, route_app in wrapped:
                    route.app = route_app
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

    def _check_lease_ttl(self, ttl: object) -> float:
        """What the backend checks of a lease's ttl at every acquire, checked once here
        (with the backend's drift and margin), so a bad guard fails where it is declared,
        not on every request."""
        if self._given is not None:
            drift, margin = self._given.drift, self._given.margin
        else:
            defaults = inspect.signature(asynclock.connect).parameters
            drift = self._options.get("drift", defaults["drift"].default)
            margin = self._options.get("margin", defaults["margin"].default)
            if not all(isinstance(v, int | float) for v in (drift, margin)):
                # connect() says what is wrong with them when the app starts
                drift, margin = 0.0, 0.0
        return asynclock.check_seconds(ttl, "ttl", lease=True, drift=drift, margin=margin)

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
        ttl = self._check_lease_ttl(ttl)
        if timeout is not None:
            timeout = asynclock.check_seconds(timeout, "timeout", zero=True)
        if max_hold is not None:
            max_hold = asynclock.check_seconds(max_hold, "max_hold")
        if retry_after is not None:
            retry_after = asynclock.check_seconds(retry_after, "retry_after", zero=True)
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
            if _LOCK_PARAM in signature.parameters:
                raise TypeError(f"an endpoint parameter may not be named {_LOCK_PARAM!r}")
            fields = [signature.parameters[f] for f in name_template.fields]
            for param in fields:
                if _is_guard_lease(param):
                    raise TypeError(
                        f"lock name template {template!r} uses {param.name}, the guard's own "
                        "lease: name the lock after the request's parameters instead"
                    )
            answers = Answers(locks, busy_status, lost_retry, outage_retry, scope == "request")
            lock_dependency = _make_lock_dependency(
                locks, name_template, fields, info, timeout, max_hold, answers
            )

            @functools.wraps(endpoint)
            async def guarded(*args: Any, **kwargs: Any) -> Any:
                state: _GuardState = kwargs.pop(_LOCK_PARAM)
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

            lock_depends = Depends(lock_dependency, scope=scope)
            hidden = [
                inspect.Parameter(
                    _LOCK_PARAM, inspect.Parameter.KEYWORD_ONLY, default=lock_depends
                ),
            ]

            async def lease_of(state: _GuardState = lock_depends) -> Lease:
                assert state.lease is not None
                return state.lease

            # The endpoint's own `Depends(guard_lease)` parameters depend on the lock
            # dependency itself, so FastAPI skips them (and answers 422) when its parameters
            # fail validation, instead of asking for a lease that was never taken.
            params = [_depend_on(p, lease_of) for p in signature.parameters.values()]
            if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
                raise TypeError(
                    f"{endpoint.__qualname__}: a guarded endpoint takes named parameters "
                    "only (FastAPI passes every value by name), not *args, **kwargs or /"
                )
            # The lock dependency goes first: FastAPI resolves dependencies in parameter
            # order, so the lease exists before guard_lease (or anything using it) is
            # resolved. All keyword-only, so defaults need no ordering (FastAPI passes
            # values by name).
            keyword = [p.replace(kind=p.KEYWORD_ONLY) for p in params]
            guarded.__signature__ = signature.replace(  # type: ignore[attr-defined]
                parameters=[*hidden, *keyword]
            )
            setattr(guarded, GUARD_ATTR, info)
            if scope == "request" and all(_is_plain(p) for p in fields):
                # This guard can also be held around its route (see _route): the lifespan
                # decides, when it sees the route.
                lock_options = {
                    "ttl": ttl,
                    "timeout": timeout,
                    "blocking": timeout is not None,
                    "max_hold": max_hold,
                }
                twin = twin_endpoint(endpoint, signature, header, answers)
                route_guard = RouteGuard(name_template, twin, lock_options, answers)
                setattr(guarded, ROUTE_ATTR, route_guard)
            return guarded  # type: ignore[return-value]

        return decorate

    def limit(
        self,
        template: str,
        limit: int,
        *,
        ttl: float,
        timeout: float | None = None,
        busy_status: int = 429,
        retry_after: float = 1.0,
    ) -> Callable[[F], F]:
        """At most ``limit`` requests of the name ``template`` (formatted from the
        endpoint's parameters; a plain string limits the whole route) in their endpoint at
        once, across every worker and server that shares the lock server: each holds one
        of ``limit`` permits of ``backend.semaphore(name, limit)`` while its endpoint runs.

        Put it under the route decorator (``@app.get(...)`` then ``@locks.limit(...)``).
        In the endpoint, :func:`asynclock_fastapi.current_permit` (``.slot``, ``.token``)
        and ``asynclock.current_lease()`` (the permit's lease).

        Args:
            template: the semaphore's name, with fields naming endpoint parameters.
            limit: the number of permits (1 .. 10 000).
            ttl: the permit's ttl; renewed while the endpoint runs.
            timeout: ``None`` (default): full answers ``busy_status`` at once. A number:
                wait up to that many seconds for a permit first.
            busy_status: the status when every permit is held (default 429).
            retry_after: the ``Retry-After`` seconds (an integer >= 1, rounded up) of that
                answer and of a 503 when the lock server cannot be reached.

        A lost permit cancels the endpoint and answers 503 with ``Retry-After`` (the ttl).
        The permit is released when the endpoint returns, before the response is sent (a
        streaming body runs without it). Semaphores exist on memory, SQLite, Redis (one
        server) and PostgreSQL; elsewhere the first request fails with NotImplementedError.
        """
        from ._limit import make_limit

        return make_limit(
            self,
            template,
            limit,
            ttl=self._check_lease_ttl(ttl),
            timeout=timeout,
            busy_status=busy_status,
            retry_after=retry_after,
        )

    def idempotent(
        self,
        *,
        ttl: float,
        keep: float = DEFAULT_KEEP,
        required: bool = True,
        header: str = "Idempotency-Key",
        replay_header: str = "Idempotent-Replayed",
        identity: Callable[[Request], str | Awaitable[str]] | None = None,
        wait: float = 0,
        retry_after: float = 1.0,
        keep_headers: Sequence[str] = (),
    ) -> Callable[[F], F]:
        """Answer a retried request (same ``Idempotency-Key``, same request) with the first
        request's response instead of running it again (IETF draft "The Idempotency-Key
        HTTP Header Field"). Needs :func:`install` (its middleware keeps the responses).

        Put it under the route decorator of an unsafe method (``@app.post(...)`` then
        ``@locks.idempotent(ttl=10)``); GET, HEAD, OPTIONS requests pass through.

        Args:
            ttl: the lease ttl of the key while the request runs (renewed; its loss
                cancels the endpoint and answers 503).
            keep: seconds a response is kept for replays (1 s to 30 days; 24 h).
            required: a request without the header gets 400 (False: it runs as usual).
            header: the request header with the key.
            replay_header: the response header (``true``) marking a replayed answer.
            identity: ``identity(request)`` (sync or async) -> str: the caller the key
                belongs to (the user, the API key), so two callers' keys never clash.
            wait: seconds a request waits for the running request with its key to finish
                (then gets its answer); 0: 409 at once.
            retry_after: the ``Retry-After`` seconds of a 409 (in progress) and of a 503
                (lock server unreachable).
            keep_headers: response headers replayed besides ``Content-Type`` (``Location``).

        Raises:
            TypeError: a sync ``def`` endpoint; bad option types.
            ValueError: an option out of its bounds.
        """
        from ._idempotent import make_idempotent

        decorate = make_idempotent(
            self,
            ttl=ttl,
            keep=keep,
            required=required,
            header=header,
            replay_header=replay_header,
            identity=identity,
            wait=wait,
            retry_after=retry_after,
            keep_headers=keep_headers,
        )
        self._idempotent += 1
        return decorate
