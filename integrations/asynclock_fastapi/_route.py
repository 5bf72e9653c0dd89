"""The guard's fast way: its lease held by an ASGI wrapper around the route, not a dependency.

Why. A guard holds its lease in a dependency with ``yield`` (``_plumbing``): that is the only
place inside FastAPI whose ``async with`` spans the endpoint, the response *and* its
background tasks. FastAPI charges ~90 µs of CPU a request for such a dependency
(``benchmarks/bench_fastapi.py``, row ``manual+yield`` against ``manual``), which put a
guarded route 15 % behind the same lock written by hand in the endpoint. Starlette runs a
response's background tasks inside the response call, so an ``async with`` around the
matched route's ASGI app spans exactly what the dependency spans, for the price of one
function call.

How. ``Locks.lifespan(app)`` receives the app at start-up. For each route it can serve this
way it sets ``route.app`` to :func:`_wrapper` around the app of a twin route: the same
route made for a *twin endpoint* without the lock dependency (built by ``guard`` when the
guard is declared, see :func:`twin_endpoint`). The wrapper formats the lock name from
``scope["path_params"]`` (and the query string), acquires, puts the lease in the request's
state (``guard_lease`` reads it there) and in ``asynclock.current_lease()`` (the wrapper's
context is the request's), and runs the twin route inside the lock. Busy, unavailable and
lost are answered by the same :class:`~._plumbing.Answers` as on the dependency path; the
wrapper raises them before the route's exception handling, so the app's own handlers answer.
At shutdown the routes get their own apps back.

Which routes (the rest keep the dependency, which does the same things the same way):

- ``release="response"`` (with ``"endpoint"`` the lease ends before the response, a point
  only FastAPI's function-scoped dependency marks);
- every template field is a required plain ``str`` parameter, read from the path (``{x}``
  or ``{x:path}``) or the query string: the values FastAPI would validate into are the raw
  ones. Body fields and dependency results exist only after FastAPI resolved them;
- no request body: FastAPI reads and validates the body before any dependency, so a guard
  on a route with a body takes its lock after the body arrived (a slow client cannot hold
  the lock by sending slowly; a malformed body is answered without taking it);
- no route-, router- or app-level ``dependencies=[...]``: they run before the guard (an
  auth check answers 401 without taking the lock) and ``guard_lease`` is not theirs;
- a plain ``APIRoute`` directly on the app (``@app.get``): a custom ``route_class`` keeps
  its own handler, an included router's routes are served by FastAPI's include context;
- routes present when the app starts, in an app whose lifespan enters ``locks.lifespan(app)``.

Pinned by ``tests/integrations/test_fastapi_route.py``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Annotated, Any, get_args, get_origin

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.convertors import PathConvertor, StringConvertor
from starlette.datastructures import QueryParams

from asynclock import AcquireTimeout, BackendUnavailable, LeaseLost, LockHeld, NameTemplate

from ._common import _REQUEST_PARAM, _RESPONSE_PARAM, GUARD_ATTR, STATE_KEY, _GuardState
from ._plumbing import Answers, annotate_span, lock_name, missing_query

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Attribute on a guarded endpoint whose guard can be held around the route: its RouteGuard.
ROUTE_ATTR = "__asynclock_route_guard__"
#: What APIRoute() takes besides path and endpoint, all kept on the route under these names.
_ROUTE_OPTIONS = tuple(
    name
    for name, param in inspect.signature(APIRoute.__init__).parameters.items()
    if param.kind is param.KEYWORD_ONLY
)


class RouteGuard:
    """One guard as the route wrapper holds it: the lock, the twin endpoint, the answers."""

    __slots__ = ("answers", "endpoint", "fields", "lock_options", "template")

    def __init__(
        self,
        template: NameTemplate,
        endpoint: Callable[..., Any],
        lock_options: dict[str, Any],
        answers: Answers,
    ) -> None:
        self.template = template
        self.fields = template.fields
        self.endpoint = endpoint
        self.lock_options = lock_options
        self.answers = answers


def twin_endpoint(
    endpoint: Callable[..., Any],
    signature: inspect.Signature,
    header: str | None,
    answers: Answers,
) -> Callable[..., Any]:
    """The endpoint as the route wrapper runs it: the lease is already held (the request's
    state has it); the endpoint's own parameters are left as they are (``guard_lease``
    reads the state)."""

    # FastAPI passes the request (the response) to one parameter only: the endpoint's own
    # if it has one.
    request_param = _param_of(signature, Request)
    response_param = _param_of(signature, Response)
    request_key = request_param or _REQUEST_PARAM
    response_key = response_param or _RESPONSE_PARAM

    @functools.wraps(endpoint)
    async def twin(**kwargs: Any) -> Any:
        request: Request = kwargs[request_key] if request_param else kwargs.pop(request_key)
        response: Response = kwargs[response_key] if response_param else kwargs.pop(response_key)
        state: _GuardState = request.scope[STATE_KEY]
        lease = state.lease
        assert lease is not None
        token = str(lease.token)
        if header is not None:
            response.headers[header] = token
        try:
            result = await endpoint(**kwargs)
            # Lost while the endpoint ran but it reached no checkpoint after the
            # cancellation: its work is not known to have been exclusive.
            lease.check()
        except LeaseLost as exc:
            # Answered here, not by the route's exception handlers, so Retry-After is the
            # guard's (as the lock dependency answers it).
            if lease.lost and exc.token == lease.token:
                state.lost_answered = True  # the wrapper's `async with` raises it again
                raise answers.lost(exc, request.scope) from None
            raise
        state.returned = True
        if header is not None and isinstance(result, Response):
            result.headers[header] = token
        return result

    hidden = [
        inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=cls)
        for key, cls, own in (
            (_REQUEST_PARAM, Request, request_param),
            (_RESPONSE_PARAM, Response, response_param),
        )
        if own is None
    ]
    keyword = [p.replace(kind=p.KEYWORD_ONLY) for p in signature.parameters.values()]
    twin.__signature__ = signature.replace(parameters=[*hidden, *keyword])  # type: ignore[attr-defined]
    setattr(twin, GUARD_ATTR, getattr(endpoint, GUARD_ATTR, None))
    return twin


def _param_of(signature: inspect.Signature, cls: type) -> str | None:
    """The parameter FastAPI passes the ``cls`` (Request, Response) of the request to."""
    for param in signature.parameters.values():
        annotation = param.annotation
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        if isinstance(annotation, type) and issubclass(annotation, cls):
            return param.name
    return None


def wrap_routes(app: Any, locks: object) -> list[tuple[APIRoute, ASGIApp]]:
    """Hold the guards of ``locks`` around the routes of ``app`` that allow it; returns each
    wrapped route with the app to give it back."""
    routes = getattr(getattr(app, "router", None), "routes", None)
    wrapped: list[tuple[APIRoute, ASGIApp]] = []
    for route in routes or ():
        guard = getattr(route.endpoint, ROUTE_ATTR, None) if type(route) is APIRoute else None
        if not isinstance(guard, RouteGuard) or guard.answers.locks is not locks:
            continue
        if route.dependencies or route.body_field is not None:
            continue
        convertors = route.param_convertors
        if any(
            not isinstance(convertors[f], StringConvertor | PathConvertor)
            for f in guard.fields
            if f in convertors
        ):
            continue
        if not all(hasattr(route, option) for option in _ROUTE_OPTIONS):
            continue  # a FastAPI whose routes keep their options otherwise
        options = {option: getattr(route, option) for option in _ROUTE_OPTIONS}
        twin = APIRoute(route.path, guard.endpoint, **options)
        wrapped.append((route, route.app))
        route.app = _wrapper(guard, twin.app, [f for f in guard.fields if f not in convertors])
    return wrapped


def _wrapper(guard: RouteGuard, route_app: ASGIApp, query: list[str]) -> ASGIApp:
    """The route's app inside ``async with backend.lock(...)``."""
    template, answers, options = guard.template, guard.answers, guard.lock_options
    locks = answers.locks

    async def guarded_route(scope: Scope, receive: Receive, send: Send) -> None:
        values = scope["path_params"]
        if query:
            values = dict(values)
            params = QueryParams(scope["query_string"])
            for field in query:
                value = params.get(field)
                if value is None:
                    raise missing_query(field)
                values[field] = value
        name = lock_name(template, values)
        state = scope[STATE_KEY] = _GuardState()
        try:
            async with locks.backend.lock(name, **options) as lease:
                state.lease = lease
                annotate_span(lease, template)
                await route_app(scope, receive, send)
        except (LockHeld, AcquireTimeout, BackendUnavailable, LeaseLost) as exc:
            if state.lost_answered and isinstance(exc, LeaseLost):
                return  # the route has sent its 503
            await answers.raise_for(exc, state, name, scope)
            raise

    return guarded_route
