"""asynclock_fastapi, holder side: ``@locks.guard`` on real uvicorn, httpx and Redis.

Each test runs the app in a uvicorn server thread (its own event loop, a TCP port) and
talks to it with httpx; endpoints wait on gates the test opens, so every interleaving is
made by events, not by sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
import httpx
import pytest
from fastapi import BackgroundTasks, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

import asynclock
from asynclock_fastapi import Locks, guard_lease, install
from tests.support.asgi_servers import recording_logs, serving, wait_thread_event
from tests.support.redis_servers import RedisFactory, RedisServer, delete_lock_keys, wait_until

pytestmark = pytest.mark.anyio
Lease = asynclock.Lease


class Gate:
    """A point an endpoint reaches (``arrived``) and waits at until the test ``opens`` it."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.opened = threading.Event()

    async def passage(self) -> None:
        """In the server: say we are here, then wait (cancellable) until opened."""
        self.arrived.set()
        await anyio.to_thread.run_sync(self.opened.wait, 30, abandon_on_cancel=True)

    async def reached(self) -> None:
        await wait_thread_event(self.arrived)

    def open(self) -> None:
        self.opened.set()


def make_app(url: str) -> tuple[FastAPI, Locks]:
    locks = Locks(url)
    return install(FastAPI(lifespan=locks.lifespan)), locks


async def held(url: str, name: str, token: int) -> bool:
    async with asynclock.connect(url) as backend:
        return await backend.validate(name, token)


@pytest.fixture(params=["redis", "postgres", "sqlite"])
def lock_spec(request: pytest.FixtureRequest) -> str:
    """Which lock backend (a ``*_spec`` parameter, so ``--backend redis`` selects by it)."""
    name: str = request.param
    return name


@pytest.fixture
def lock_url(lock_spec: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if lock_spec == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if lock_spec == "postgres":
        return str(request.getfixturevalue("pg_server").url())
    return f"sqlite:///{tmp_path / 'locks.db'}"


async def test_concurrent_requests_hold_one_at_a_time_with_rising_tokens(
    lock_url: str, lock_name: str
) -> None:
    app, locks = make_app(lock_url)
    entered: list[int] = []
    inside = 0
    most_inside = 0

    @app.post("/jobs/{key}")
    @locks.guard("job:{key}", ttl=5, timeout=30)
    async def work(key: str, lease: Lease = Depends(guard_lease)) -> dict[str, Any]:
        nonlocal inside, most_inside
        assert asynclock.current_lease() is lease  # the context's lease is the guard's too
        assert lease.name == f"job:{key}"
        inside += 1
        most_inside = max(most_inside, inside)
        entered.append(lease.token)
        await anyio.sleep(0.005)  # yield while holding: the other requests try meanwhile
        inside -= 1
        return {"token": lease.token}

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            responses: list[httpx.Response] = []

            async def one() -> None:
                responses.append(await client.post(f"/jobs/{lock_name}"))

            with anyio.fail_after(40):
                async with anyio.create_task_group() as tg:
                    for _ in range(8):
                        tg.start_soon(one)
    assert [r.status_code for r in responses] == [200] * 8
    assert most_inside == 1
    assert entered == sorted(entered) and len(set(entered)) == 8
    for r in responses:
        assert r.headers["Fencing-Token"] == str(r.json()["token"])


async def test_busy_is_409_at_once_or_after_the_timeout(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    gate = Gate()

    @app.post("/hold/{key}")
    @locks.guard("busy:{key}", ttl=5)
    async def hold(key: str) -> str:
        await gate.passage()
        return "done"

    @app.post("/wait/{key}")
    @locks.guard("busy:{key}", ttl=5, timeout=0.3)
    async def wait(key: str, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    @app.post("/wait-long/{key}")
    @locks.guard("busy:{key}", ttl=5, timeout=30)
    async def wait_long(key: str, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                first: list[httpx.Response] = []

                async def holder() -> None:
                    first.append(await client.post(f"/hold/{lock_name}"))

                tg.start_soon(holder)
                await gate.reached()
                busy = await client.post(f"/hold/{lock_name}")
                assert busy.status_code == 409
                assert "busy" in busy.json()["detail"]
                assert 1 <= int(busy.headers["Retry-After"]) <= 5
                started = time.monotonic()
                waited = await client.post(f"/wait/{lock_name}")
                assert waited.status_code == 409
                assert time.monotonic() - started >= 0.3
                # A waiter within its timeout gets the lock when the holder finishes.
                later: list[httpx.Response] = []

                async def waiter() -> None:
                    later.append(await client.post(f"/wait-long/{lock_name}"))

                tg.start_soon(waiter)
                gate.open()
            assert first[0].status_code == 200
            assert later[0].status_code == 200
            assert later[0].json() > int(first[0].headers["Fencing-Token"])


async def test_loss_mid_request_is_503_with_retry_after_and_no_traceback(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    gate = Gate()
    seen: dict[str, Any] = {}

    @app.post("/rebuild/{key}")
    @locks.guard("lost:{key}", ttl=1)
    async def rebuild(key: str, lease: Lease = Depends(guard_lease)) -> str:
        seen["lease"] = lease
        try:
            await gate.passage()  # never opened: the loss must stop us
        except BaseException as exc:
            seen["stopped_by"] = type(exc).__name__
            raise
        seen["finished"] = True
        return "rebuilt"

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                answers: list[httpx.Response] = []

                async def call() -> None:
                    answers.append(await client.post(f"/rebuild/{lock_name}"))

                tg.start_soon(call)
                await gate.reached()
                await delete_lock_keys([redis_server.url], f"lost:{lock_name}")
    answer = answers[0]
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "1"
    assert "lock lost" in answer.json()["detail"]
    assert seen["lease"].lost and "finished" not in seen
    assert seen["stopped_by"] == "CancelledError"  # cancelled inside the endpoint
    assert logs.tracebacks() == []
    assert not [m for m in logs.messages("uvicorn") if "Exception" in m]
    assert any("stopped" in m for m in logs.messages("asynclock_fastapi"))


async def test_restart_grace_of_a_fresh_redis_is_503_with_retry_after_not_409(
    tmp_path: Path, lock_name: str
) -> None:
    """A new deployment on a freshly started Redis with the default options: the server
    grants nothing during its restart grace. That is an outage with a known end (503 and
    Retry-After), not a conflict (409 "held by another owner")."""
    redis = RedisServer(tmp_path / "fresh").start(settle=False)  # as a user gets it
    try:
        app, locks = make_app(redis.url)

        @app.post("/rebuild/{key}")
        @locks.guard("grace:{key}", ttl=8)
        async def rebuild(key: str, lease: Lease = Depends(guard_lease)) -> int:
            return lease.token

        @app.post("/wait/{key}")
        @locks.guard("grace-wait:{key}", ttl=8, timeout=0.2)
        async def short_wait(key: str) -> str:
            return "done"

        @app.post("/own/{key}")
        async def own(key: str) -> str:  # the endpoint's own lock, mapped by install()
            async with locks.backend.lock(f"grace-own:{key}", ttl=8, blocking=False):
                pass
            return "done"

        @app.post("/patient/{key}")
        @locks.guard("grace-patient:{key}", ttl=8, timeout=30)
        async def patient(key: str, lease: Lease = Depends(guard_lease)) -> int:
            return lease.token

        with recording_logs() as logs, serving(app) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                for path in ("rebuild", "wait", "own"):
                    answer = await client.post(f"/{path}/{lock_name}")
                    assert answer.status_code == 503, (path, answer.text)
                    assert 1 <= int(answer.headers["Retry-After"]) <= 8, path
                    detail = answer.json()["detail"]
                    assert "lock server is in its restart grace until 20" in detail, path
                    assert str(redis.port) not in detail  # where it is: for the log only
                # A request that may wait longer than the grace waits through it.
                with anyio.fail_after(30):
                    waited = await client.post(f"/patient/{lock_name}")
                assert waited.status_code == 200 and waited.json() > 0
                # And then it is over: the lock is granted at once.
                assert (await client.post(f"/rebuild/{lock_name}")).status_code == 200
                # kill -9 and a restart without persistence: a new grace, the same answers.
                await anyio.to_thread.run_sync(lambda: redis.restart(keep_data=False))
                again = await client.post(f"/rebuild/{lock_name}")
                assert again.status_code == 503, again.text
                assert 1 <= int(again.headers["Retry-After"]) <= 8
                assert "restart grace" in again.json()["detail"]
        assert logs.tracebacks() == []
    finally:
        redis.stop()


async def test_an_unreachable_lock_server_is_503_with_retry_after_and_no_traceback(
    redis_factory: RedisFactory, lock_name: str
) -> None:
    redis = redis_factory()
    app, locks = make_app(redis.url)

    @app.post("/at-once/{key}")
    @locks.guard("down:{key}", ttl=5)
    async def at_once(key: str) -> str:
        return "done"

    @app.post("/waiting/{key}")
    @locks.guard("down:{key}", ttl=5, timeout=5, retry_after=7)
    async def waiting(key: str) -> str:
        return "done"

    @app.post("/own/{key}")
    async def own(key: str) -> bool:  # the endpoint's own call, mapped by install()
        return await locks.backend.validate(f"down:{key}", 1)

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.post(f"/at-once/{lock_name}")).status_code == 200
            redis.kill()
            for path, retry in (("at-once", "1"), ("waiting", "7"), ("own", "1")):
                answer = await client.post(f"/{path}/{lock_name}")
                assert answer.status_code == 503, (path, answer.text)
                assert answer.headers["Retry-After"] == retry, path
                detail = answer.json()["detail"]
                assert detail.startswith("the lock server is unavailable"), path
                assert str(redis.port) not in detail  # where it is: for the log only
    assert logs.tracebacks() == []
    warnings = [m for m in logs.messages("asynclock_fastapi") if "lock server unavailable" in m]
    assert len(warnings) == 3 and all(str(redis.port) in m for m in warnings)


@pytest.mark.parametrize("release", ["response", "endpoint"])
async def test_release_timing_against_response_background_tasks_and_dependency_scopes(
    redis_server: RedisServer, lock_name: str, release: str
) -> None:
    """Default: released after the response and its background tasks; "endpoint": when
    the endpoint returns, before the response. Teardown of the route's own dependencies
    (either scope) runs under the lease by default."""
    app, locks = make_app(redis_server.url)
    background = Gate()
    teardown: dict[str, bool] = {}

    async def function_scoped(lease: Lease = Depends(guard_lease)) -> AsyncIterator[None]:
        yield
        teardown["function"] = lease.released

    async def request_scoped(lease: Lease = Depends(guard_lease)) -> AsyncIterator[None]:
        yield
        teardown["request"] = lease.released

    @app.post("/report/{key}")
    @locks.guard("report:{key}", ttl=5, release=release)  # type: ignore[arg-type]
    async def report(
        key: str,
        tasks: BackgroundTasks,
        _f: None = Depends(function_scoped, scope="function"),
        _r: None = Depends(request_scoped),
        lease: Lease = Depends(guard_lease),
    ) -> int:
        tasks.add_task(background.passage)
        return lease.token

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answer = await client.post(f"/report/{lock_name}")
            assert answer.status_code == 200
            token = answer.json()
            name = f"report:{lock_name}"
            await background.reached()  # the client has its answer; the task still runs
            if release == "response":
                assert await held(redis_server.url, name, token)
                # The function-scope teardown ran before the response; the request-scope
                # one waits for the background task, and both saw the lease held.
                assert teardown == {"function": False}
                background.open()
                await wait_until(lambda: "request" in teardown)
                assert teardown == {"function": False, "request": False}

                async def released() -> bool:  # the guard's exit comes after the teardown
                    return not await held(redis_server.url, name, token)

                await wait_until(released)
            else:
                assert not await held(redis_server.url, name, token)
                # A request-scope dependency's teardown runs after the lease is released.
                background.open()
                await wait_until(lambda: "request" in teardown)
                assert teardown == {"function": False, "request": True}


async def test_streaming_response_lost_mid_stream_is_cut_short_without_traceback(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    more = Gate()
    stream_state: dict[str, str] = {}

    @app.get("/export/{key}")
    @locks.guard("export:{key}", ttl=1)
    async def export(key: str) -> StreamingResponse:
        async def rows() -> AsyncIterator[bytes]:
            try:
                yield b"row 1\n"
                await more.passage()  # never opened: the loss must stop the stream
                yield b"row 2\n"
            except BaseException as exc:
                stream_state["stopped_by"] = type(exc).__name__
                raise

        return StreamingResponse(rows(), media_type="text/plain")

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with client.stream("GET", f"/export/{lock_name}") as answer:
                assert answer.status_code == 200
                assert int(answer.headers["Fencing-Token"]) > 0
                chunks = answer.aiter_raw()
                assert await chunks.__anext__() == b"row 1\n"
                await more.reached()
                await delete_lock_keys([redis_server.url], f"export:{lock_name}")
                with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
                    async for _ in chunks:
                        pass
    assert stream_state["stopped_by"] == "CancelledError"
    assert logs.tracebacks() == []
    assert any("cut short" in m for m in logs.messages("asynclock_fastapi"))
    # uvicorn says, in one line, that the response ended early (it closes the connection).
    assert "ASGI callable returned without completing response." in logs.messages("uvicorn")


async def test_with_release_endpoint_a_stream_runs_without_the_lease(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, locks = make_app(redis_server.url)
    more = Gate()

    @app.get("/export/{key}")
    @locks.guard("export:{key}", ttl=5, release="endpoint")
    async def export(key: str) -> StreamingResponse:
        async def rows() -> AsyncIterator[bytes]:
            yield b"row 1\n"
            await more.passage()
            yield b"row 2\n"

        return StreamingResponse(rows(), media_type="text/plain")

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with client.stream("GET", f"/export/{lock_name}") as answer:
                token = int(answer.headers["Fencing-Token"])
                chunks = answer.aiter_raw()
                assert await chunks.__anext__() == b"row 1\n"
                await more.reached()
                assert not await held(redis_server.url, f"export:{lock_name}", token)
                more.open()
                assert [chunk async for chunk in chunks] == [b"row 2\n"]


async def test_loss_during_a_background_task_stops_it_quietly(
    redis_server: RedisServer, lock_name: str
) -> None:
    """By default background tasks run under the lease; a loss then cancels the task
    (the client already has its answer) and logs one warning, no traceback."""
    app, locks = make_app(redis_server.url)
    task = Gate()
    task_state: dict[str, str] = {}

    async def send_mail() -> None:
        try:
            await task.passage()  # never opened
        except BaseException as exc:
            task_state["stopped_by"] = type(exc).__name__
            raise

    @app.post("/signup/{key}")
    @locks.guard("signup:{key}", ttl=1)
    async def signup(key: str, tasks: BackgroundTasks) -> str:
        tasks.add_task(send_mail)
        return "welcome"

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answer = await client.post(f"/signup/{lock_name}")
            assert answer.status_code == 200 and answer.json() == "welcome"
            await task.reached()
            await delete_lock_keys([redis_server.url], f"signup:{lock_name}")
            await wait_until(lambda: "stopped_by" in task_state)
    assert task_state["stopped_by"] == "CancelledError"
    assert logs.tracebacks() == []
    assert any("after the response was sent" in m for m in logs.messages("asynclock_fastapi"))


async def test_without_install_the_guard_still_answers_409_and_503(
    redis_server: RedisServer, lock_name: str
) -> None:
    locks = Locks(redis_server.url)
    app = FastAPI(lifespan=locks.lifespan)  # no install(app)
    gate, stream_gate = Gate(), Gate()

    @app.post("/work/{key}")
    @locks.guard("bare:{key}", ttl=1)
    async def work(key: str) -> str:
        await gate.passage()  # never opened
        return "done"

    @app.get("/stream/{key}")
    @locks.guard("bare-stream:{key}", ttl=1)
    async def stream(key: str) -> StreamingResponse:
        async def rows() -> AsyncIterator[bytes]:
            yield b"row 1\n"
            await stream_gate.passage()  # never opened

        return StreamingResponse(rows())

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with anyio.create_task_group() as tg:
                answers: list[httpx.Response] = []

                async def call() -> None:
                    answers.append(await client.post(f"/work/{lock_name}"))

                tg.start_soon(call)
                await gate.reached()
                busy = await client.post(f"/work/{lock_name}")
                assert busy.status_code == 409 and "Retry-After" in busy.headers
                await delete_lock_keys([redis_server.url], f"bare:{lock_name}")
            assert answers[0].status_code == 503 and answers[0].headers["Retry-After"] == "1"
            assert logs.tracebacks() == []
            # After the response started, only install()'s middleware can end it quietly:
            # without it the server logs a traceback, and the guard says what to do.
            async with client.stream("GET", f"/stream/{lock_name}") as answer:
                chunks = answer.aiter_raw()
                assert await chunks.__anext__() == b"row 1\n"
                await stream_gate.reached()
                await delete_lock_keys([redis_server.url], f"bare-stream:{lock_name}")
                with pytest.raises(httpx.RemoteProtocolError):
                    async for _ in chunks:
                        pass
    assert any("call asynclock_fastapi.install(app)" in m for m in logs.messages("asynclock"))


async def test_openapi_documents_busy_and_lost_answers_and_the_token_header(
    redis_server: RedisServer,
) -> None:
    app, locks = make_app(redis_server.url)
    shared: dict[int | str, dict[str, Any]] = {"409": {"description": "our own words"}}

    @app.post("/accounts/{account_id}/rebuild", status_code=201, responses=shared)
    @locks.guard("account:{account_id}", ttl=10)
    async def rebuild(account_id: int, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    @app.get("/other", responses=shared)
    async def other() -> None: ...

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            schema = (await client.get("/openapi.json")).json()
            answer = await client.post("/accounts/7/rebuild")
    assert answer.status_code == 201
    operation = schema["paths"]["/accounts/{account_id}/rebuild"]["post"]
    assert {"201", "409", "503", "422"} <= set(operation["responses"])
    assert "Retry-After" in operation["responses"]["503"]["headers"]
    assert operation["responses"]["409"]["description"] == "our own words"  # the route's own
    assert set(schema["paths"]["/other"]["get"]["responses"]) == {"200", "409"}
    assert shared == {"409": {"description": "our own words"}}  # not changed in place
    assert "Fencing-Token" in operation["responses"]["201"]["headers"]
    # The hidden hold parameter is not a documented parameter; the path parameter is.
    assert [p["name"] for p in operation["parameters"]] == ["account_id"]


async def test_name_is_made_from_validated_path_and_query_values(
    redis_server: RedisServer,
) -> None:
    app, locks = make_app(redis_server.url)

    @app.get("/a/{account_id}")
    @locks.guard("acct:{account_id}:{region}", ttl=5)
    async def read(account_id: int, region: str = "eu", lease: Lease = Depends(guard_lease)) -> str:
        return lease.name

    async def writer(lease: Lease = Depends(guard_lease)) -> str:
        return f"writer with token {lease.token}"  # a dependency of the route using the lease

    @app.get("/b/{account_id}")
    @locks.guard("acct:{account_id}", ttl=5)
    async def nested(account_id: int, who: str = Depends(writer)) -> str:
        return who

    @app.get("/q")
    @locks.guard("q:{tenant}:{job}", ttl=5)
    async def by_query(tenant: str, job: str, lease: Lease = Depends(guard_lease)) -> str:
        assert lease.name == f"q:{tenant}:{job}"  # the values FastAPI gave the endpoint
        return lease.name

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            named = await client.get("/q", params=[("tenant", "a b"), ("job", "1"), ("job", "2")])
            assert named.json() == "q:a b:2"  # as FastAPI reads them: the last of a repeat
            missing = await client.get("/q", params={"tenant": "a"})
            assert missing.status_code == 422
            assert missing.json()["detail"][0]["loc"] == ["query", "job"]
            assert (await client.get("/b/1")).json().startswith("writer with token ")
            assert (await client.get("/b/x")).status_code == 422
            assert (await client.get("/a/007", params={"region": "us"})).json() == "acct:7:us"
            assert (await client.get("/a/8")).json() == "acct:8:eu"
            assert (await client.get("/a/x")).status_code == 422  # refused before locking
            too_long = await client.get("/a/1", params={"region": "r" * 600})
            assert too_long.status_code == 422
            assert "cannot make the lock name" in too_long.json()["detail"]


@pytest.mark.parametrize("style", ["nested", "wrap"])
async def test_lifespan_composes_with_the_apps_own(
    redis_server: RedisServer, lock_name: str, style: str
) -> None:
    locks = Locks(redis_server.url)
    events: list[str] = []

    @asynccontextmanager
    async def own(app: FastAPI) -> AsyncIterator[dict[str, str]]:
        events.append("own start")
        yield {"db": "connected"}
        events.append("own stop")

    @asynccontextmanager
    async def nested(app: FastAPI) -> AsyncIterator[dict[str, str]]:
        async with locks.lifespan(app), own(app) as state:
            yield state

    app = install(FastAPI(lifespan=nested if style == "nested" else locks.wrap(own)))

    @app.post("/r/{key}")
    @locks.guard("life:{key}", ttl=5)
    async def route(key: str, request: Request, lease: Lease = Depends(guard_lease)) -> str:
        return f"{request.state.db} {lease.token > 0}"

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.post(f"/r/{lock_name}")).json() == "connected True"
    assert events == ["own start", "own stop"]
    with pytest.raises(RuntimeError, match="not open"):
        _ = locks.backend


class Order(BaseModel):
    id: int
    item: str


async def test_name_from_a_body_field_and_an_annotated_lease(
    redis_server: RedisServer,
) -> None:
    app, locks = make_app(redis_server.url)

    @app.post("/orders")
    @locks.guard("order:{order.id}", ttl=5)
    async def place(order: Order, lease: Annotated[Lease, Depends(guard_lease)]) -> str:
        return f"{lease.name} {order.item}"

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answer = await client.post("/orders", json={"id": 5, "item": "tea"})
            assert answer.json() == "order:5 tea"  # the body is the model itself, not embedded
            assert (await client.post("/orders", json={"id": "x"})).status_code == 422


async def test_locks_over_a_backend_you_made(tmp_path: Path, lock_name: str) -> None:
    backend = asynclock.connect(f"sqlite:///{tmp_path / 'locks.db'}")
    locks = Locks(backend=backend)
    app = install(FastAPI(lifespan=locks.lifespan))

    @app.post("/r/{key}")
    @locks.guard("own:{key}", ttl=5)
    async def route(key: str, lease: Lease = Depends(guard_lease)) -> bool:
        return locks.backend is backend and lease.name == f"own:{key}"

    assert "closed" in repr(locks)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.post(f"/r/{lock_name}")).json() is True
    with pytest.raises(TypeError, match="go with a URL"):
        Locks(backend=backend, drift=0.02)


def test_guard_refuses_at_decoration_time() -> None:
    locks = Locks("memory://")

    def sync_endpoint(key: str) -> None: ...

    with pytest.raises(TypeError, match="async def"):
        locks.guard("k:{key}", ttl=5)(sync_endpoint)  # type: ignore[type-var]

    async def endpoint(key: str) -> None: ...

    with pytest.raises(TypeError, match="uses account_id"):
        locks.guard("acct:{account_id}", ttl=5)(endpoint)
    with pytest.raises(ValueError, match="ttl must be a finite number"):
        locks.guard("k:{key}", ttl=0)
    with pytest.raises(ValueError, match="release must be"):
        locks.guard("k:{key}", ttl=5, release="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positional field"):
        locks.guard("k:{}", ttl=5)

    async def own(lease: Lease = Depends(guard_lease)) -> None: ...

    with pytest.raises(TypeError, match="the guard's own lease"):
        locks.guard("k:{lease}", ttl=5)(own)
    with pytest.raises(TypeError, match="exactly one"):
        Locks()
    with pytest.raises(RuntimeError, match="not open"):
        _ = locks.backend


async def test_a_lease_ttl_the_backend_refuses_is_refused_where_the_guard_is_declared(
    tmp_path: Path,
) -> None:
    """The backend refuses these ttls at every acquire, so each request would fail; the
    guard says so when it is declared, in the backend's own words."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    cases = [  # drift, margin, ttl, what the backend says
        (0.01, 0.005, 0.001, r"ttl=0.001s leaves no time after drift \(1%\) and margin \(0.005s\)"),
        (0.01, 0.005, 2 * asynclock.MAX_TTL, "ttl must be at most 604800 seconds"),
        (0.01, 0.005, asynclock.MAX_TTL + 0.5, "ttl must be at most 604800 seconds"),
        (0.01, 0.5, 0.5, r"margin \(0.5s\); use a ttl of at least 1.001s"),
        (0.2, 0.005, 0.006, r"after drift \(20%\)"),
    ]
    for drift, margin, ttl, message in cases:
        with pytest.raises(ValueError, match=message):
            Locks(url, drift=drift, margin=margin).guard("k:{key}", ttl=ttl)
        backend = asynclock.connect(url, drift=drift, margin=margin)
        with pytest.raises(ValueError, match=message):
            Locks(backend=backend).guard("k:{key}", ttl=ttl)
        async with backend:  # what every request would have met
            with pytest.raises(ValueError, match=message):
                async with backend.lock("k", ttl=ttl):
                    pass
    # The defaults, and at the bounds: accepted, as the backend accepts them.
    with pytest.raises(ValueError, match=r"ttl=0\.001s leaves no time"):
        Locks(url).guard("k:{key}", ttl=0.001)
    for margin, ttl in [(0.005, asynclock.MAX_TTL), (0.005, 0.011), (0.5, 1.001)]:
        Locks(url, margin=margin).guard("k:{key}", ttl=ttl)
        async with asynclock.connect(url, margin=margin) as backend:
            async with backend.lock("k", ttl=ttl, blocking=False) as lease:
                assert lease.ttl == ttl


def test_the_integration_uses_only_the_public_asynclock_api() -> None:
    import ast
    from pathlib import Path

    import asynclock_fastapi

    package = Path(asynclock_fastapi.__file__).parent
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                assert not node.module.startswith("asynclock._"), f"{source.name}: {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("asynclock._"), f"{source.name}"
    assert isinstance(asynclock_fastapi.__all__, tuple)
    assert set(asynclock_fastapi.__all__) == {
        "DEFAULT_HEADER",
        "MAX_TOKEN",
        "FencedWrite",
        "FencedWrites",
        "FencingAuth",
        "FencingToken",
        "GuardInfo",
        "IdempotencyInfo",
        "Locks",
        "LostDuringResponse",
        "ResponsePhase",
        "current_permit",
        "guard_lease",
        "fence_responses",
        "fenced_write",
        "fencing_token",
        "guard_info",
        "idempotency_info",
        "install",
    }
    for name in asynclock_fastapi.__all__:
        assert hasattr(asynclock_fastapi, name), name


def test_httpx_is_imported_only_for_fencing_auth() -> None:
    import subprocess
    import sys

    code = (
        "import sys, asynclock_fastapi; assert 'httpx' not in sys.modules; "
        "asynclock_fastapi.FencingAuth; assert 'httpx' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_the_requests_span_carries_the_guards_token_and_template(
    redis_server: RedisServer, lock_name: str
) -> None:
    """With OpenTelemetry, the request's span (the ASGI/FastAPI instrumentation's server
    span; here a middleware's) gets the guard's fencing token and template, on both ways
    a guard holds its lease (around the route's app; in its dependency)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    app, locks = make_app(redis_server.url)

    class SpanPerRequest:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            with tracer.start_as_current_span(f"{scope['method']} {scope['path']}"):
                await self.app(scope, receive, send)

    app.add_middleware(SpanPerRequest)

    @app.post("/wrapped/{key}")
    @locks.guard("wrapped:{key}", ttl=5)
    async def wrapped(key: str, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    @app.post("/dependency/{number}")
    @locks.guard("dependency:{number}", ttl=5)
    async def dependency(number: int, lease: Lease = Depends(guard_lease)) -> int:
        return lease.token

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            with anyio.fail_after(30):
                first = (await client.post(f"/wrapped/{lock_name}")).json()
                second = (await client.post("/dependency/7")).json()
    spans = {s.name: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
    assert spans[f"POST /wrapped/{lock_name}"] == {
        "asynclock.lease.token": first,
        "asynclock.lock.name_template": "wrapped:{key}",
    }
    assert spans["POST /dependency/7"] == {
        "asynclock.lease.token": second,
        "asynclock.lock.name_template": "dependency:{number}",
    }
