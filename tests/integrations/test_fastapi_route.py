"""asynclock_fastapi: a guard held around its route (``_route``), on real uvicorn and Redis.

``Locks.lifespan(app)`` wraps the app of each route whose guard can be held there; the rest
keep the lock dependency. Which way a request went is read from FastAPI itself: the lock
dependency is overridden (``app.dependency_overrides``), so a request that resolves it
either fails loudly (the route way must not) or is counted (the dependency way must). The
promises the guard makes (see test_fastapi_guard.py, which runs both ways) are checked here
on the route way once more, each where it could break: the lease in dependencies and
background tasks, 409/503 answers, release after a 422.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from fastapi import BackgroundTasks, Depends, FastAPI, Request
from pydantic import BaseModel

import asynclock
from asynclock_fastapi import Locks, guard_lease
from asynclock_fastapi._common import _LOCK_PARAM
from tests.integrations.test_fastapi_guard import Gate, make_app
from tests.support.asgi_servers import recording_logs, serving, wait_thread_event
from tests.support.redis_servers import RedisServer, delete_lock_keys

pytestmark = pytest.mark.anyio
Lease = asynclock.Lease


def lock_dependency_of(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """The guard's lock dependency (the first parameter of a guarded endpoint)."""
    dependency: Callable[..., Any] = (
        inspect.signature(endpoint).parameters[_LOCK_PARAM].default.dependency
    )
    return dependency


def refuse_lock_dependency(app: FastAPI, endpoint: Callable[..., Any]) -> None:
    """Make the guard's lock dependency fail the request (500) if FastAPI resolves it."""

    async def refuse() -> None:
        raise AssertionError("the guard's lock dependency ran: the route way was not taken")

    app.dependency_overrides[lock_dependency_of(endpoint)] = refuse


def count_lock_dependency(app: FastAPI, endpoint: Callable[..., Any]) -> list[str]:
    """Count the requests that resolve the guard's lock dependency (which still does its job)."""
    original = lock_dependency_of(endpoint)
    calls: list[str] = []

    async def counted(**values: Any) -> AsyncIterator[Any]:
        calls.append("lock dependency")
        async with asynccontextmanager(original)(**values) as state:
            yield state

    counted.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    app.dependency_overrides[original] = counted
    return calls


@asynccontextmanager
async def in_flight(
    client: httpx.AsyncClient, url: str, gate: Gate
) -> AsyncIterator[list[httpx.Response]]:
    """A POST sent in the background and waiting at ``gate`` inside the block; its answer is
    in the list after the block (which opens the gate or ends the lease)."""
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await client.post(url))

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await gate.reached()
        yield answers


async def free_again(url: str, name: str) -> int:
    """Wait (on the backend's release notification, 10 s at most) until ``name`` is free;
    the token the next holder gets. A lock left behind fails here: the guards' ttl is 30 s."""
    async with asynclock.connect(url) as backend, backend.lock(name, ttl=5, timeout=10) as lease:
        token = lease.token
    return token


async def test_documented_defaults_on_a_fresh_server_take_the_route_way(
    redis_server: RedisServer, lock_name: str
) -> None:
    """The docs' first example as written (no install()): 200 with the token header, 409
    while held, released after the response."""
    locks = Locks(redis_server.url)
    app = FastAPI(lifespan=locks.lifespan)
    gate = Gate()

    @app.post("/accounts/{account_id}/rebuild")
    @locks.guard("account:{account_id}", ttl=30)
    async def rebuild(account_id: str, lease: Lease = Depends(guard_lease)) -> dict[str, Any]:
        if account_id.endswith("slow"):
            await gate.passage()
        return {"token": lease.token, "current": asynclock.current_lease().token}

    refuse_lock_dependency(app, rebuild)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            done = await client.post(f"/accounts/{lock_name}/rebuild")
            assert done.status_code == 200, done.text
            body = done.json()
            assert body["token"] == body["current"] == int(done.headers["Fencing-Token"])
            assert await free_again(redis_server.url, f"account:{lock_name}") > body["token"]

            slow = f"/accounts/{lock_name}slow/rebuild"
            async with in_flight(client, slow, gate) as first:
                busy = await client.post(slow)
                assert busy.status_code == 409
                assert "busy" in busy.json()["detail"]
                assert 1 <= int(busy.headers["Retry-After"]) <= 30
                gate.open()
            assert first[0].status_code == 200


async def test_the_lease_reaches_dependencies_and_background_tasks_and_ends_after_them(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    seen: dict[str, Any] = {}
    background_done = threading.Event()

    async def in_dependency(lease: Lease = Depends(guard_lease)) -> int:
        seen["dependency"] = (asynclock.current_lease().token, lease.token)
        return lease.token

    @app.get("/items/{key}")
    @locks.guard("bg:{key}:{tenant}", ttl=30)
    async def item(
        key: str,
        tenant: str,
        tasks: BackgroundTasks,
        from_dependency: int = Depends(in_dependency),
        lease: Lease = Depends(guard_lease),
    ) -> int:
        async def later() -> None:
            current = asynclock.current_lease()
            seen["background"] = (current.token, current.name)
            seen["valid in background"] = await locks.backend.validate(lease.name, lease.token)
            background_done.set()

        tasks.add_task(later)
        assert from_dependency == lease.token
        return lease.token

    refuse_lock_dependency(app, item)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answer = await client.get(f"/items/{lock_name}", params={"tenant": "t1"})
            assert answer.status_code == 200, answer.text
            token = answer.json()
            await wait_thread_event(background_done)
            name = f"bg:{lock_name}:t1"  # the query field is read from the query string
            assert seen["dependency"] == (token, token)
            assert seen["background"] == (token, name)
            assert seen["valid in background"] is True
            assert await free_again(redis_server.url, name) > token
            missing = await client.get(f"/items/{lock_name}")  # no tenant: 422, no lock
            assert missing.status_code == 422
            assert missing.json()["detail"][0]["loc"] == ["query", "tenant"]


async def test_a_422_after_the_lock_was_taken_releases_it(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)

    @app.get("/v/{key}")
    @locks.guard("v:{key}", ttl=30)
    async def validated(key: str, count: int, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    refuse_lock_dependency(app, validated)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            good = await client.get(f"/v/{lock_name}", params={"count": "1"})
            assert good.status_code == 200, good.text
            bad = await client.get(f"/v/{lock_name}", params={"count": "many"})
            assert bad.status_code == 422
            assert bad.json()["detail"][0]["loc"] == ["query", "count"]
            # Taken for the bad request (a later token), and released after its 422.
            assert await free_again(redis_server.url, f"v:{lock_name}") > good.json() + 1


async def test_loss_before_the_response_started_is_503_and_cancels_the_endpoint(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    gate = Gate()
    seen: dict[str, Any] = {}

    @app.post("/rebuild/{key}")
    @locks.guard("lost:{key}", ttl=2)
    async def rebuild(key: str, lease: Lease = Depends(guard_lease)) -> str:
        seen["lease"] = lease
        await gate.passage()  # never opened: only the loss (a cancellation) ends it
        seen["finished"] = True
        return "rebuilt"

    refuse_lock_dependency(app, rebuild)
    with recording_logs() as logs, serving(app) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            in_flight(client, f"/rebuild/{lock_name}", gate) as answers,
        ):
            await delete_lock_keys([redis_server.url], f"lost:{lock_name}")
    answer = answers[0]
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "2"  # the guard's ttl, not install()'s 1 s
    assert "lock lost" in answer.json()["detail"]
    assert seen["lease"].lost and "finished" not in seen  # stopped where it waited
    assert logs.tracebacks() == []


class Order(BaseModel):
    id: int
    item: str


async def test_routes_the_wrapper_cannot_serve_keep_the_lock_dependency(
    redis_server: RedisServer, lock_name: str
) -> None:
    """A body field in the name, a route-level dependency, release="endpoint": each still
    guarded, through the lock dependency; a path-param guard next to them is not."""
    app, locks = make_app(redis_server.url)
    checked: list[str] = []

    async def auth(request: Request) -> None:
        checked.append(request.url.path)

    @app.post("/orders")
    @locks.guard(f"order:{lock_name}:{{order.id}}", ttl=30)
    async def by_body(order: Order, lease: Lease = Depends(guard_lease)) -> list[Any]:
        return [lease.name, lease.token, asynclock.current_lease().token]

    @app.post("/authed/{key}", dependencies=[Depends(auth)])
    @locks.guard("authed:{key}", ttl=30)
    async def authed(key: str, lease: Lease = Depends(guard_lease)) -> str:
        return lease.name

    @app.post("/early/{key}")
    @locks.guard("early:{key}", ttl=30, release="endpoint")
    async def early(key: str, lease: Lease = Depends(guard_lease)) -> str:
        return lease.name

    @app.post("/fast/{key}")
    @locks.guard("fast:{key}", ttl=30)
    async def fast(key: str, lease: Lease = Depends(guard_lease)) -> str:
        return lease.name

    calls = {
        "body": count_lock_dependency(app, by_body),
        "authed": count_lock_dependency(app, authed),
        "early": count_lock_dependency(app, early),
    }
    refuse_lock_dependency(app, fast)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            ordered = await client.post("/orders", json={"id": 7, "item": "tea"})
            assert ordered.status_code == 200, ordered.text
            name, token, current = ordered.json()
            assert name == f"order:{lock_name}:7" and current == token
            assert (await client.post(f"/authed/{lock_name}")).json() == f"authed:{lock_name}"
            assert checked == [f"/authed/{lock_name}"]
            assert (await client.post(f"/early/{lock_name}")).json() == f"early:{lock_name}"
            assert (await client.post(f"/fast/{lock_name}")).json() == f"fast:{lock_name}"
    assert calls == {"body": ["lock dependency"]} | {
        k: ["lock dependency"] for k in ("authed", "early")
    }


async def test_each_start_wraps_the_routes_anew_and_shutdown_gives_them_back(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)

    @app.get("/r/{key}")
    @locks.guard("again:{key}", ttl=30)
    async def route(key: str, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    refuse_lock_dependency(app, route)
    (api_route,) = [r for r in app.router.routes if getattr(r, "endpoint", None) is route]
    own_app = api_route.app  # type: ignore[attr-defined]
    tokens = []
    for _ in range(2):
        with serving(app) as server:
            assert api_route.app is not own_app  # type: ignore[attr-defined]
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                answer = await client.get(f"/r/{lock_name}")
                assert answer.status_code == 200, answer.text
                tokens.append(answer.json())
        assert api_route.app is own_app  # type: ignore[attr-defined]
    assert tokens[1] > tokens[0]
