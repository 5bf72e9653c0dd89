"""asynclock_fastapi: ``@locks.idempotent`` (the Idempotency-Key header) on real uvicorn,
httpx, Redis and SQLite.

Each answer of the IETF draft (400 missing key, 422 reused with another payload, 409 while
the first runs, the first answer replayed) and what the brief adds (what is stored, what
frees the key, 410 for a response too large, 503 for an unreachable lock server, OpenAPI,
included routers) is checked against a real server. Interleavings are made with gates the
test opens, never with sleeps.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import APIRouter, FastAPI, Form, HTTPException, Request, Response, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import asynclock
from asynclock_fastapi import Locks, idempotency_info, install
from tests.integrations.test_fastapi_guard import Gate
from tests.support.asgi_servers import recording_logs, serving
from tests.support.redis_servers import RedisFactory, RedisServer, delete_lock_keys
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

#: Bytes no serializer would produce by itself (spacing, key order, a non-ASCII character):
#: a replay must send exactly these.
ODD_BODY = b'{ "z" : 1,\n  "a":"caf\xc3\xa9" }  '


@pytest.fixture(params=["redis", "sqlite", "postgres", "etcd"])
def lock_spec(request: pytest.FixtureRequest) -> str:
    """Which lock backend (a ``*_spec`` parameter, so ``--backend redis`` selects by it)."""
    name: str = request.param
    return name


@pytest.fixture
def lock_url(lock_spec: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if lock_spec == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if lock_spec == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    spec: BackendSpec = request.getfixturevalue(f"spec_{lock_spec}")
    return spec.url


class Order(BaseModel):
    item: str
    quantity: int = 1


class Counter:
    """How often each endpoint body ran (the server thread writes, the test reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[str, int] = {}

    def add(self, what: str) -> int:
        with self._lock:
            self.runs[what] = self.runs.get(what, 0) + 1
            return self.runs[what]


def make_app(
    url: str, ttl: float = 10, **options: Any
) -> tuple[FastAPI, Locks, Counter, dict[str, Gate]]:
    locks = Locks(url)
    app = install(FastAPI(lifespan=locks.lifespan))
    counter = Counter()
    gates: dict[str, Gate] = {}
    idempotent = locks.idempotent(ttl=ttl, keep_headers=("Location", "X-Tag"), **options)

    @app.post("/orders", status_code=201)
    @idempotent
    async def create(order: Order, response: Response, gate: str | None = None) -> dict[str, Any]:
        n = counter.add("orders")
        if gate is not None:
            await gates[gate].passage()
        response.headers["Location"] = f"/orders/{n}"
        response.headers["X-Not-Kept"] = str(n)
        return {"order": n, "item": order.item, "quantity": order.quantity}

    @app.post("/odd")
    @idempotent
    async def odd() -> Response:
        counter.add("odd")
        response = Response(
            ODD_BODY, status_code=202, media_type="application/x-odd; charset=utf-8"
        )
        response.raw_headers += [(b"x-tag", b"one"), (b"x-tag", b"two")]
        return response

    @app.post("/flaky/{mode}")
    @idempotent
    async def flaky(mode: str) -> Response:
        n = counter.add(f"flaky/{mode}")
        if n == 1:
            if mode == "raise":
                raise RuntimeError("boom: not stored, the key is freed")
            if mode == "http503":
                raise HTTPException(503, detail="try later")
            return JSONResponse({"attempt": n}, status_code=int(mode))
        return JSONResponse({"attempt": n})

    @app.post("/missing/{thing}")
    @idempotent
    async def missing(thing: str) -> None:
        counter.add("missing")
        raise HTTPException(404, detail=f"no {thing}")

    @app.post("/big")
    @idempotent
    async def big(size: int = 100_000) -> Response:
        counter.add("big")
        return Response(b"x" * size, media_type="text/plain")

    @app.post("/hold")
    @idempotent
    async def hold() -> dict[str, Any]:
        lease = asynclock.current_lease()  # the key's lease: the body runs under it
        n = counter.add("hold")
        leases.append(lease)
        if n == 1:
            await gates["hold"].passage()  # cancelled when the lease is lost
        return {"token": lease.token, "run": n}

    leases: list[asynclock.Lease] = []
    app.state.leases = leases
    return app, locks, counter, gates


def key(name: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{name}"'}


async def post_order(client: httpx.AsyncClient, name: str) -> httpx.Response:
    """An order whose endpoint waits at gate "g"."""
    return await client.post(
        "/orders", json={"item": "tea"}, params={"gate": "g"}, headers=key(name)
    )


async def test_first_answer_is_replayed_byte_for_byte_with_the_headers_that_matter(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, _ = make_app(lock_url)
    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post("/orders", json={"item": "tea"}, headers=key(lock_name))
            assert first.status_code == 201, first.text
            assert first.json() == {"order": 1, "item": "tea", "quantity": 1}
            assert "Idempotent-Replayed" not in first.headers
            for _ in range(2):
                again = await client.post("/orders", json={"item": "tea"}, headers=key(lock_name))
                assert again.status_code == 201
                assert again.content == first.content
                assert again.headers["Idempotent-Replayed"] == "true"
                assert again.headers["Content-Type"] == first.headers["Content-Type"]
                assert again.headers["Location"] == "/orders/1"  # keep_headers
                assert "X-Not-Kept" not in again.headers
            assert counter.runs["orders"] == 1
            # The bare form of the same key (Stripe's clients) is the same key.
            bare = await client.post(
                "/orders", json={"item": "tea"}, headers={"Idempotency-Key": lock_name}
            )
            assert bare.headers["Idempotent-Replayed"] == "true"
            # Another key runs again.
            other = await client.post("/orders", json={"item": "tea"}, headers=key(lock_name + "2"))
            assert other.json()["order"] == 2

            odd = await client.post("/odd", headers=key(lock_name))
            assert (odd.status_code, odd.content) == (202, ODD_BODY)
            replay = await client.post("/odd", headers=key(lock_name))
            assert (replay.status_code, replay.content) == (202, ODD_BODY)
            assert replay.headers["Content-Type"] == "application/x-odd; charset=utf-8"
            assert replay.headers.get_list("X-Tag") == ["one", "two"]
            assert counter.runs["odd"] == 1
    assert logs.tracebacks() == []


async def test_missing_or_malformed_key_is_400_saying_what_is_allowed(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            missing = await client.post("/orders", json={"item": "tea"})
            assert missing.status_code == 400
            assert "needs an Idempotency-Key header" in missing.json()["detail"]
            bad_values: list[str | bytes] = [
                '""',  # empty
                '"' + "k" * 256 + '"',  # too long
                "k" * 256,
                '"a\\x"',  # not an escape
                '"a"b"',
                "a b",  # a bare value with a space
                '"caf\u00e9"'.encode("latin-1"),  # not ASCII
            ]
            for value in bad_values:
                answer = await client.post(
                    "/orders",
                    json={"item": "tea"},
                    headers=[
                        (b"Idempotency-Key", value.encode() if isinstance(value, str) else value)
                    ],
                )
                assert answer.status_code == 400, value
                detail = answer.json()["detail"]
                assert detail.startswith("invalid Idempotency-Key header"), detail
                assert "structured-field string of 1 to 255 characters" in detail
            longest = '"' + "k" * 255 + '"'
            ok = await client.post(
                "/orders", json={"item": lock_name}, headers={"Idempotency-Key": longest}
            )
            assert ok.status_code == 201
            escaped = await client.post(
                "/orders", json={"item": lock_name}, headers={"Idempotency-Key": '"a\\"b\\\\c"'}
            )
            assert escaped.status_code == 201
    assert counter.runs["orders"] == 2


async def test_optional_key_runs_without_one(lock_url: str, lock_name: str) -> None:
    app, _, counter, _ = make_app(lock_url, required=False)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(2):
                answer = await client.post("/orders", json={"item": "tea"})
                assert answer.status_code == 201
            assert counter.runs["orders"] == 2


async def test_form_and_multipart_bodies_reach_the_endpoint_and_are_fingerprinted(
    lock_url: str, lock_name: str
) -> None:
    """The key reads the body to fingerprint it; FastAPI's form parser still gets all of
    it (URL-encoded and multipart with a file), a duplicate is replayed and another form
    with the same key is 422."""
    locks = Locks(lock_url)
    app = install(FastAPI(lifespan=locks.lifespan))
    counter = Counter()

    @app.post("/signup")
    @locks.idempotent(ttl=10)
    async def signup(email: str = Form(), plan: str = Form("free")) -> dict[str, Any]:
        return {"run": counter.add("signup"), "email": email, "plan": plan}

    @app.post("/upload")
    @locks.idempotent(ttl=10)
    async def upload(note: str = Form(), file: UploadFile | None = None) -> dict[str, Any]:
        data = await file.read() if file is not None else b""
        return {"run": counter.add("upload"), "note": note, "size": len(data)}

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            form = {"email": "a@example.com", "plan": "pro"}
            first = await client.post("/signup", data=form, headers=key(f"{lock_name}-f"))
            assert first.json() == {"run": 1, "email": "a@example.com", "plan": "pro"}
            again = await client.post("/signup", data=form, headers=key(f"{lock_name}-f"))
            assert again.content == first.content
            assert again.headers["Idempotent-Replayed"] == "true"
            other = {"email": "b@example.com"}
            reused = await client.post("/signup", data=other, headers=key(f"{lock_name}-f"))
            assert reused.status_code == 422, reused.text

            payload = b"\x00\x01" * 40_000  # 80 kB: more than one read of the stream
            files = {"file": ("a.bin", payload, "application/octet-stream")}
            sent = await client.post(
                "/upload", data={"note": "n"}, files=files, headers=key(f"{lock_name}-u")
            )
            assert sent.json() == {"run": 1, "note": "n", "size": 80_000}, sent.text
            replay = await client.post(
                "/upload", data={"note": "n"}, files=files, headers=key(f"{lock_name}-u")
            )
            # Another multipart boundary (httpx picks one per request), the same form: replayed.
            assert replay.content == sent.content, replay.text
            assert replay.headers["Idempotent-Replayed"] == "true"
            changed = {"file": ("a.bin", payload[:-1] + b"\x02", "application/octet-stream")}
            reused = await client.post(
                "/upload", data={"note": "n"}, files=changed, headers=key(f"{lock_name}-u")
            )
            assert reused.status_code == 422, reused.text
    assert counter.runs == {"signup": 1, "upload": 1}


async def test_reused_key_with_another_payload_is_422(lock_url: str, lock_name: str) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post("/orders", json={"item": "tea"}, headers=key(lock_name))
            assert first.status_code == 201
            for kwargs in (
                {"json": {"item": "coffee"}},  # another body
                {"json": {"item": "tea"}, "params": {"x": "1"}},  # another query
                # another JSON value: a key the first did not send (its default's value)
                {"json": {"item": "tea", "quantity": 1}},
            ):
                answer = await client.post("/orders", headers=key(lock_name), **kwargs)
                assert answer.status_code == 422, answer.text
                assert "used with a different request" in answer.json()["detail"]
            # Another route with the same key is another scope: it runs.
            odd = await client.post("/odd", headers=key(lock_name))
            assert odd.status_code == 202
    assert counter.runs["orders"] == 1


async def test_a_json_body_is_compared_by_its_value_and_other_bodies_by_their_bytes(
    lock_url: str, lock_name: str
) -> None:
    """A client that serialises the same JSON again (other spacing, key order, escapes,
    ``1.50`` for ``1.5``) sends the same request: replayed. Another value (``1`` where the
    first sent ``1.0``) is 422; a body that is not JSON counts by its bytes."""
    app, locks, counter, _ = make_app(lock_url)

    @app.post("/notes")
    @locks.idempotent(ttl=10)
    async def note(request: Request) -> dict[str, Any]:
        return {"run": counter.add("notes"), "size": len(await request.body())}

    json_type = {"Content-Type": "application/json"}
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post(
                "/orders",
                content=b'{"item":"tea","quantity":2,"price":1.5}',
                headers={**key(lock_name), **json_type},
            )
            assert first.status_code == 201, first.text
            for again in (
                b'{ "price" : 1.50,\n  "quantity": 2, "item" : "t\\u0065a" }',
                b'{"quantity":2,"price":15e-1,"item":"tea"}',
            ):
                replay = await client.post(
                    "/orders",
                    content=again,
                    headers={**key(lock_name), "Content-Type": "application/json; charset=utf-8"},
                )
                assert replay.status_code == 201, replay.text
                assert replay.headers["Idempotent-Replayed"] == "true"
                assert replay.content == first.content
            other = await client.post(
                "/orders",
                content=b'{"item":"tea","quantity":2.0,"price":1.5}',
                headers={**key(lock_name), **json_type},
            )
            assert other.status_code == 422, other.text

            text = {**key(f"{lock_name}-t"), "Content-Type": "text/plain"}
            ran = await client.post("/notes", content=b'{"a": 1}', headers=text)
            assert ran.json() == {"run": 1, "size": 8}
            reused = await client.post("/notes", content=b'{"a":1}', headers=text)
            assert reused.status_code == 422, reused.text
    assert counter.runs == {"orders": 1, "notes": 1}


async def test_two_idempotency_key_header_lines_are_400(lock_url: str, lock_name: str) -> None:
    """The header is one structured-field string: sent on two lines (the same key or two)
    it is 400, as two values on one line are; nothing runs."""
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for lines in (
                [f'"{lock_name}-a"', f'"{lock_name}-b"'],
                [f'"{lock_name}-a"', f'"{lock_name}-a"'],
                [f'"{lock_name}-a", "{lock_name}-b"'],
            ):
                answer = await client.post(
                    "/orders",
                    json={"item": "tea"},
                    headers=[(b"Idempotency-Key", line.encode()) for line in lines],
                )
                assert answer.status_code == 400, (lines, answer.text)
                assert answer.json()["detail"].startswith("invalid Idempotency-Key header")
    assert counter.runs == {}


async def test_a_duplicate_while_the_first_runs_is_409_with_retry_after(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, gates = make_app(lock_url, retry_after=3)
    gates["g"] = Gate()
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers: list[httpx.Response] = []

            async def first() -> None:
                answers.append(
                    await client.post(
                        "/orders",
                        json={"item": "tea"},
                        params={"gate": "g"},
                        headers=key(lock_name),
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await gates["g"].reached()
                busy = await client.post(
                    "/orders", json={"item": "tea"}, params={"gate": "g"}, headers=key(lock_name)
                )
                assert busy.status_code == 409, busy.text
                assert busy.headers["Retry-After"] == "3"
                assert "still being processed" in busy.json()["detail"]
                gates["g"].open()
            assert answers[0].status_code == 201
            replay = await client.post(
                "/orders", json={"item": "tea"}, params={"gate": "g"}, headers=key(lock_name)
            )
            assert replay.content == answers[0].content
    assert counter.runs["orders"] == 1


async def test_twenty_concurrent_duplicates_run_once_and_get_the_same_bytes(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, gates = make_app(lock_url, wait=20)
    gates["g"] = Gate()
    with recording_logs() as logs, serving(app) as server:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            answers: list[httpx.Response] = []

            async def send() -> None:
                answers.append(
                    await client.post(
                        "/orders",
                        json={"item": "tea"},
                        params={"gate": "g"},
                        headers=key(lock_name),
                    )
                )

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(send)
                await gates["g"].reached()  # one runs; the others wait for its answer
                gates["g"].open()
    assert counter.runs["orders"] == 1
    assert len(answers) == 20
    assert {(a.status_code, a.content) for a in answers} == {
        (answers[0].status_code, answers[0].content)
    }
    assert answers[0].status_code == 201
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 19
    assert logs.tracebacks() == []


@pytest.mark.parametrize("mode", ["500", "503", "408", "409", "425", "429", "http503", "raise"])
async def test_5xx_retry_statuses_and_exceptions_free_the_key(
    lock_url: str, lock_name: str, mode: str
) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            # uvicorn closes the connection after an error it logs: a new one for the retry
            close = {"Connection": "close"}
            first = await client.post(f"/flaky/{mode}", headers={**key(lock_name), **close})
            expected = {"http503": 503, "raise": 500}.get(mode) or int(mode)
            assert first.status_code == expected, first.text
            assert "Idempotent-Replayed" not in first.headers
            retry = await client.post(f"/flaky/{mode}", headers=key(lock_name))
            assert retry.status_code == 200 and retry.json() == {"attempt": 2}
            replay = await client.post(f"/flaky/{mode}", headers=key(lock_name))
            assert replay.json() == {"attempt": 2}
            assert replay.headers["Idempotent-Replayed"] == "true"
    assert counter.runs[f"flaky/{mode}"] == 2


@pytest.mark.parametrize("mode", ["400", "404", "422", "302"])
async def test_2xx_3xx_and_other_4xx_are_stored(lock_url: str, lock_name: str, mode: str) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post(f"/flaky/{mode}", headers=key(lock_name))
            assert first.status_code == int(mode)
            replay = await client.post(f"/flaky/{mode}", headers=key(lock_name))
            assert (replay.status_code, replay.content) == (first.status_code, first.content)
            assert replay.headers["Idempotent-Replayed"] == "true"
            # An HTTPException the endpoint raises, as the app's handler answers it.
            missing = await client.post("/missing/cup", headers=key(lock_name))
            assert missing.status_code == 404 and missing.json() == {"detail": "no cup"}
            again = await client.post("/missing/cup", headers=key(lock_name))
            assert (again.status_code, again.content) == (404, missing.content)
            assert again.headers["Idempotent-Replayed"] == "true"
    assert counter.runs[f"flaky/{mode}"] == 1
    assert counter.runs["missing"] == 1


async def test_a_response_too_large_to_keep_goes_out_once_then_410(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post("/big", headers=key(lock_name))
            assert first.status_code == 200 and first.content == b"x" * 100_000
            again = await client.post("/big", headers=key(lock_name))
            assert again.status_code == 410, again.text
            assert again.json()["status"] == 200
            assert "too large to keep" in again.json()["detail"]
            # The documented size that is kept: a body a little under 48 KiB.
            kept = await client.post("/big", params={"size": 48_000}, headers=key(lock_name + "k"))
            replay = await client.post(
                "/big", params={"size": 48_000}, headers=key(lock_name + "k")
            )
            assert replay.headers["Idempotent-Replayed"] == "true"
            assert replay.content == kept.content == b"x" * 48_000
    assert counter.runs["big"] == 2


async def test_identity_keeps_two_callers_keys_apart(lock_url: str, lock_name: str) -> None:
    async def user(request: Request) -> str:
        return request.headers["X-User"]

    app, _, counter, _ = make_app(lock_url, identity=user)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for who in ("ann", "bob", "ann"):
                answer = await client.post(
                    "/orders", json={"item": "tea"}, headers={**key(lock_name), "X-User": who}
                )
                assert answer.status_code == 201
    assert counter.runs["orders"] == 2


async def test_an_unreachable_lock_server_is_503_with_retry_after(
    redis_factory: RedisFactory, lock_name: str
) -> None:
    redis = redis_factory()
    app, _, counter, _ = make_app(redis.url, retry_after=4)
    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await client.post("/odd", headers=key(lock_name))).status_code == 202
            redis.kill()
            down = await client.post("/odd", headers=key(lock_name + "2"))
            assert down.status_code == 503, down.text
            assert down.headers["Retry-After"] == "4"
            assert down.json()["detail"].startswith("the lock server is unavailable")
            assert str(redis.port) not in down.text
    assert counter.runs["odd"] == 1
    assert logs.tracebacks() == []


async def test_documented_defaults_on_a_fresh_redis_and_an_included_router(
    redis_factory: RedisFactory, lock_name: str
) -> None:
    """The docs' example as written, on a Redis just started (its restart grace: 503 with
    Retry-After, never a 500), on a route of an included APIRouter."""
    redis = redis_factory(fresh=True)
    locks = Locks(redis.url)
    app = install(FastAPI(lifespan=locks.lifespan))
    router = APIRouter(prefix="/v1")
    runs = Counter()

    @router.post("/payments/{order_id}", status_code=201)
    @locks.idempotent(ttl=10)
    async def pay(order_id: str, order: Order) -> dict[str, str]:
        runs.add(order_id)
        return {"paid": order_id}

    @router.post("/patient/{order_id}", status_code=201)
    @locks.idempotent(ttl=10, wait=30)
    async def patient(order_id: str, order: Order) -> dict[str, str]:
        runs.add("patient")
        return {"paid": order_id}

    app.include_router(router)
    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            url = f"/v1/payments/{lock_name}"
            first = await client.post(url, json={"item": "tea"}, headers=key(lock_name))
            # The fresh server's restart grace: 503 with Retry-After, never a 500.
            assert first.status_code == 503, first.text
            assert "restart grace" in first.json()["detail"]
            assert int(first.headers["Retry-After"]) >= 1
            # A route that may wait longer than the grace waits through it.
            with anyio.fail_after(30):
                waited = await client.post(
                    f"/v1/patient/{lock_name}", json={"item": "tea"}, headers=key(lock_name)
                )
            assert waited.status_code == 201, waited.text
            # And then it is over: the default route runs at once.
            first = await client.post(url, json={"item": "tea"}, headers=key(lock_name))
            assert first.status_code == 201, first.text
            again = await client.post(url, json={"item": "tea"}, headers=key(lock_name))
            assert (again.status_code, again.content) == (201, first.content)
            assert again.headers["Idempotent-Replayed"] == "true"
            assert (await client.post(url, json={"item": "tea"})).status_code == 400
            schema = (await client.get("/openapi.json")).json()
            operation = schema["paths"]["/v1/payments/{order_id}"]["post"]
            assert {"400", "409", "422"} <= set(operation["responses"])
    assert runs.runs == {lock_name: 1, "patient": 1}
    assert logs.tracebacks() == []


async def test_openapi_documents_the_header_and_the_answers(tmp_path: Path) -> None:
    app, _, _, _ = make_app(f"sqlite:///{tmp_path / 'locks.db'}")
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/orders"]["post"]
    (header,) = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["in"] == "header" and header["required"] is True
    assert header["schema"]["type"] == "string" and "anyOf" not in header["schema"]
    assert "structured-field string" in header["description"]
    responses = operation["responses"]
    assert {"201", "400", "409", "410", "422", "503"} <= set(responses)
    assert "still being processed" in responses["409"]["description"]
    assert "Retry-After" in responses["409"]["headers"]
    assert "different request" in responses["422"]["description"]
    assert "Validation Error" in responses["422"]["description"]  # FastAPI's own, kept
    assert not any(p["name"].startswith("asynclock") for p in operation["parameters"])
    info = idempotency_info(app.routes[-1].endpoint)  # type: ignore[attr-defined]
    assert info is not None and info.header == "Idempotency-Key" and info.keep == 86400


def sync_endpoint() -> None: ...


async def test_misuse_is_refused_where_it_is_declared(tmp_path: Path) -> None:
    locks = Locks(f"sqlite:///{tmp_path / 'locks.db'}")
    with pytest.raises(TypeError, match="async def"):
        locks.idempotent(ttl=5)(sync_endpoint)  # type: ignore[type-var]

    with pytest.raises(ValueError, match="keep must be between"):
        locks.idempotent(ttl=5, keep=0.5)
    with pytest.raises(ValueError, match="HTTP header name"):
        locks.idempotent(ttl=5, header="Idempotency Key")
    with pytest.raises(ValueError, match="ttl"):
        locks.idempotent(ttl=10**9)
    # Without install(): the app refuses to start (not a 500 at the first request).
    app = FastAPI(lifespan=locks.lifespan)

    @app.post("/x")
    @locks.idempotent(ttl=5)
    async def x() -> None: ...

    with pytest.raises(RuntimeError, match="install"):
        async with locks.lifespan(app):
            pass


async def test_the_body_runs_under_the_keys_lease_and_stops_when_it_is_lost(
    redis_server: RedisServer, lock_name: str
) -> None:
    app, _, counter, gates = make_app(redis_server.url, ttl=1.5)
    gates["hold"] = Gate()
    leases: list[asynclock.Lease] = app.state.leases
    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers: list[httpx.Response] = []

            async def first() -> None:
                answers.append(await client.post("/hold", headers=key(lock_name)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await gates["hold"].reached()
                (lease,) = leases
                assert lease.name.startswith("\x00asynclock.idempotency:")
                assert await validate(redis_server.url, lease.name, lease.token)
                await delete_lock_keys([redis_server.url], lease.name)  # sabotage
            lost = answers[0]
            assert lost.status_code == 503, lost.text
            assert lost.headers["Retry-After"] == "2"  # the ttl, rounded up
            assert "was lost" in lost.json()["detail"]
            # Not stored: the retry runs (with a larger token) and is stored.
            retry = await client.post("/hold", headers=key(lock_name))
            assert retry.status_code == 200
            assert retry.json()["run"] == 2 and retry.json()["token"] > lease.token
            replay = await client.post("/hold", headers=key(lock_name))
            assert replay.content == retry.content
    assert counter.runs["hold"] == 2
    assert not gates["hold"].opened.is_set()  # the first body never passed its gate
    assert logs.tracebacks() == []


async def validate(url: str, name: str, token: int) -> bool:
    async with asynclock.connect(url) as backend:
        return await backend.validate(name, token)


async def test_a_duplicate_that_waits_too_long_is_409(lock_url: str, lock_name: str) -> None:
    app, _, counter, gates = make_app(lock_url, wait=0.3)
    gates["g"] = Gate()
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answers: list[httpx.Response] = []

            async def first() -> None:
                answers.append(await post_order(client, lock_name))

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await gates["g"].reached()
                with anyio.fail_after(10):
                    busy = await post_order(client, lock_name)  # waits 0.3 s, then 409
                assert busy.status_code == 409, busy.text
                assert busy.headers["Retry-After"] == "1"
                gates["g"].open()
            assert answers[0].status_code == 201
    assert counter.runs["orders"] == 1


async def test_a_request_fastapi_refuses_as_invalid_is_not_stored(
    lock_url: str, lock_name: str
) -> None:
    app, _, counter, _ = make_app(lock_url)
    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(2):
                invalid = await client.post(
                    "/orders", json={"item": "tea", "quantity": "x"}, headers=key(lock_name)
                )
                assert invalid.status_code == 422
                assert invalid.json()["detail"][0]["loc"] == ["body", "quantity"]
                assert "Idempotent-Replayed" not in invalid.headers
            # Nothing ran, nothing is kept: the key is free for the corrected request.
            fixed = await client.post(
                "/orders", json={"item": "tea", "quantity": 2}, headers=key(lock_name)
            )
            assert fixed.status_code == 201, fixed.text
    assert counter.runs["orders"] == 1


async def test_a_refused_fenced_save_sends_nothing_of_the_response_and_stores_nothing(
    redis_server: RedisServer, lock_name: str
) -> None:
    """The lease ends at the server between the endpoint's return and the save (its key
    deleted by the endpoint itself, as an expiry during a freeze would): the fenced save is
    refused, the client gets 503, never the response that was not kept, and a retry runs."""
    app, locks, counter, _ = make_app(redis_server.url)

    @app.post("/sabotaged")
    @locks.idempotent(ttl=10)
    async def sabotaged() -> dict[str, int]:
        n = counter.add("sabotaged")
        if n == 1:
            await delete_lock_keys([redis_server.url], asynclock.current_lease().name)
        return {"run": n}

    with recording_logs() as logs, serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            refused = await client.post("/sabotaged", headers=key(lock_name))
            assert refused.status_code == 503, refused.text
            assert "was lost" in refused.json()["detail"]
            assert "run" not in refused.text
            retry = await client.post("/sabotaged", headers=key(lock_name))
            assert retry.status_code == 200 and retry.json() == {"run": 2}
            replay = await client.post("/sabotaged", headers=key(lock_name))
            assert replay.headers["Idempotent-Replayed"] == "true"
            assert replay.content == retry.content
    assert counter.runs["sabotaged"] == 2
    assert logs.tracebacks() == []
