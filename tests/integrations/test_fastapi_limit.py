"""asynclock_fastapi: ``@locks.limit`` across processes (issue 42 item 5). Two uvicorn
servers, each a process of its own with its own backend, share one semaphore on Redis,
PostgreSQL or SQLite: never more than LIMIT requests in their endpoint at once, the rest
429 with ``Retry-After`` (or, with a timeout, served once a permit frees)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis

from asynclock._harness.servers import free_port
from tests.support.fastapi_limited import LIMIT
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["redis", "postgres", "sqlite"])
def lock_spec(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def lock_url(lock_spec: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if lock_spec == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if lock_spec == "postgres":
        return str(request.getfixturevalue("pg_server").url())
    return f"sqlite:///{tmp_path / 'locks.db'}"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def servers(lock_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[list[str]]:
    """Two uvicorn processes serving tests.support.fastapi_limited; their base URLs."""
    procs: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for n in range(2):
            port = free_port()
            log = (tmp_path / f"server{n}.log").open("wb")
            args = [sys.executable, "-m", "tests.support.fastapi_limited"]
            args += [lock_url, str(redis_server.url), str(port)]
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            procs.append((proc, port))
        deadline = time.monotonic() + 30
        for proc, port in procs:
            while not _port_open(port):
                assert proc.poll() is None, (tmp_path / "server0.log").read_text()
                assert time.monotonic() < deadline, "the servers did not start"
                time.sleep(0.05)  # polling for readiness, not a guess
        yield [f"http://127.0.0.1:{port}" for _, port in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _burst(urls: list[str], path: str, count: int) -> list[httpx.Response]:
    responses: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(n: int) -> None:
            responses.append(await client.post(f"{urls[n % len(urls)]}{path}"))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for n in range(count):
                    tg.start_soon(one, n)
    return responses


def _seen(redis_server: RedisServer, key: str) -> list[int]:
    client = redis.Redis.from_url(str(redis_server.url))
    return [int(x) for x in client.lrange(f"most:{key}", 0, -1)]


async def test_a_full_route_answers_429_with_retry_after_across_two_servers(
    servers: list[str], redis_server: RedisServer
) -> None:
    key = uuid.uuid4().hex[:10]
    responses = await _burst(servers, f"/export/{key}", 10)
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, [(r.status_code, r.text) for r in responses]
    served = [r.json() for r in responses if r.status_code == 200]
    assert 1 <= len(served) <= 10 - 1  # some were refused: 10 at once against a limit of 2
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "2"
    seen = _seen(redis_server, key)
    assert len(seen) == len(served) and max(seen) <= LIMIT, seen
    assert {s["slot"] for s in served} <= set(range(LIMIT))


async def test_with_a_timeout_every_request_waits_for_a_permit(
    servers: list[str], redis_server: RedisServer
) -> None:
    key = uuid.uuid4().hex[:10]
    responses = await _burst(servers, f"/queue/{key}", 8)
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    seen = _seen(redis_server, key)
    assert len(seen) == 8 and max(seen) == LIMIT, seen
    by_slot: dict[int, list[int]] = {}
    for answer in (r.json() for r in responses):
        by_slot.setdefault(answer["slot"], []).append(answer["token"])
    assert set(by_slot) <= set(range(LIMIT))
    for tokens in by_slot.values():
        assert len(tokens) == len(set(tokens))


def test_limit_refuses_bad_options_where_declared(tmp_path: Path) -> None:
    from asynclock_fastapi import Locks

    locks = Locks(f"sqlite:///{tmp_path / 'l.db'}")
    for bad in (0, -1, 10_001, True, 2.0):
        with pytest.raises((TypeError, ValueError), match="limit"):
            locks.limit("x", bad, ttl=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_status"):
        locks.limit("x", 2, ttl=5, busy_status=200)

    async def endpoint(other: str) -> Any:
        return other

    with pytest.raises(TypeError):
        locks.limit("x:{key}", 2, ttl=5)(endpoint)

    def sync_endpoint() -> None: ...

    with pytest.raises(TypeError, match="async def"):
        locks.limit("x", 2, ttl=5)(sync_endpoint)  # type: ignore[type-var]


async def test_limit_over_a_guard_keeps_both(tmp_path: Path) -> None:
    """@locks.limit above @locks.guard: the lifespan does not hold the guard around the
    route (which would call the endpoint past the limit); both still apply."""
    from fastapi import FastAPI

    from asynclock_fastapi import Locks, current_permit
    from tests.support.asgi_servers import serving

    locks = Locks(f"sqlite:///{tmp_path / 'l.db'}")
    app = FastAPI(lifespan=locks.lifespan)

    @app.post("/both/{key}")
    @locks.limit("both", 1, ttl=5)
    @locks.guard("both:{key}", ttl=5)
    async def both(key: str) -> dict[str, Any]:
        import asynclock

        return {"slot": current_permit().slot, "lease": asynclock.current_lease().name}

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            answer = await client.post("/both/k")
    assert answer.status_code == 200, answer.text
    assert answer.json()["slot"] == 0
