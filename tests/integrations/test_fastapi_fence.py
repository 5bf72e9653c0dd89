"""asynclock_fastapi, resource side: the ``Fencing-Token`` header checked atomically with the write.

A fenced service (real uvicorn, real httpx) stores items in SQLite (aiosqlite), PostgreSQL
(asyncpg) or Redis, each write going through the existing fence (``SQLFence`` in the
write's transaction, ``RedisFence``'s Lua call). A stale token answers 412, a missing one
428, a malformed one 400, and in every refused case the store is unchanged. End to end, a
guarded holder calls the service with ``FencingAuth``; a frozen holder's late call is 412.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import aiosqlite
import anyio
import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
import redis.asyncio
from fastapi import Depends, FastAPI
from pydantic import BaseModel

import asynclock
import asynclock.testing
from asynclock.fence import RedisFence, SQLFence
from asynclock_fastapi import (
    FencedWrite,
    FencingAuth,
    FencingToken,
    Locks,
    current_lease,
    fenced_write,
    fencing_token,
    install,
)
from tests.support.asgi_servers import (
    ServerThread,
    free_port,
    recording_logs,
    serving,
    wait_thread_event,
)
from tests.support.pg_servers import PgServer
from tests.support.redis_servers import RedisServer, wait_until

pytestmark = pytest.mark.anyio
STORES = ["sqlite", "postgres", "redis"]
ROOT = Path(__file__).resolve().parents[2]


class Item(BaseModel):
    value: str


class Store(Protocol):
    def lifespan(self, app: Any) -> Any: ...

    async def write(self, key: str, value: str, token: int) -> None: ...

    async def write_with(self, write: FencedWrite, key: str, value: str) -> None: ...

    async def read(self, key: str) -> tuple[str | None, int | None]: ...


class SqliteStore:
    """Items and the fence's marks in one SQLite file; each write one BEGIN IMMEDIATE."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fence = SQLFence()

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        async with aiosqlite.connect(self.path) as conn:
            await conn.execute(self.fence.create_sql)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS items (key TEXT PRIMARY KEY, value TEXT)"
            )
            await conn.commit()
        yield

    async def write(self, key: str, value: str, token: int) -> None:
        await self._write(key, value, lambda conn: self.fence.check_aiosqlite(conn, key, token))

    async def write_with(self, write: FencedWrite, key: str, value: str) -> None:
        await self._write(key, value, lambda conn: write.aiosqlite(conn, key))

    async def _write(self, key: str, value: str, check: Any) -> None:
        async with aiosqlite.connect(self.path, isolation_level=None) as conn:
            await conn.execute("BEGIN IMMEDIATE")
            try:
                await check(conn)  # G8, in the transaction
                await conn.execute(
                    "INSERT INTO items (key, value) VALUES (?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
            except BaseException:
                await conn.execute("ROLLBACK")
                raise
            await conn.execute("COMMIT")

    async def naive_write(self, key: str, value: str, token: int, pause: Any) -> None:
        """Check, then write, in two steps: what the fence exists to avoid."""
        async with aiosqlite.connect(self.path) as conn:
            cursor = await conn.execute(
                f"SELECT token FROM {self.fence.table} WHERE key = ?", (key,)
            )
            row = await cursor.fetchone()
            if row is not None and int(row[0]) > token:
                raise asynclock.StaleToken(key, token, int(row[0]))
            await pause()
            await conn.execute(
                "INSERT INTO items (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )
            await conn.execute(
                f"INSERT INTO {self.fence.table} (key, token) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET token = excluded.token",
                (key, token),
            )
            await conn.commit()

    async def read(self, key: str) -> tuple[str | None, int | None]:
        async with aiosqlite.connect(self.path) as conn:
            row = await (
                await conn.execute("SELECT value FROM items WHERE key = ?", (key,))
            ).fetchone()
            mark = await (
                await conn.execute(f"SELECT token FROM {self.fence.table} WHERE key = ?", (key,))
            ).fetchone()
        return (None if row is None else row[0]), (None if mark is None else int(mark[0]))


class PostgresStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.fence = SQLFence()
        self.pool: Any = None

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        self.pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4)
        try:
            async with self.pool.acquire() as conn:
                await self.fence.create_asyncpg(conn)
                await conn.execute(
                    "CREATE TABLE IF NOT EXISTS fastapi_items (key TEXT PRIMARY KEY, value TEXT)"
                )
            yield
        finally:
            await self.pool.close()

    async def write(self, key: str, value: str, token: int) -> None:
        await self._write(key, value, lambda conn: self.fence.check_asyncpg(conn, key, token))

    async def write_with(self, write: FencedWrite, key: str, value: str) -> None:
        await self._write(key, value, lambda conn: write.asyncpg(conn, key))

    async def _write(self, key: str, value: str, check: Any) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            await check(conn)  # G8, in the transaction
            await conn.execute(
                "INSERT INTO fastapi_items (key, value) VALUES ($1, $2) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                key,
                value,
            )

    async def read(self, key: str) -> tuple[str | None, int | None]:
        async with self.pool.acquire() as conn:
            value = await conn.fetchval("SELECT value FROM fastapi_items WHERE key = $1", key)
            mark = await conn.fetchval(f"SELECT token FROM {self.fence.table} WHERE key = $1", key)
        return value, None if mark is None else int(mark)


class RedisStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.fence = RedisFence()
        self.client: Any = None

    @asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        self.client = redis.asyncio.Redis.from_url(self.url, decode_responses=True)
        try:
            yield
        finally:
            await self.client.aclose()

    async def write(self, key: str, value: str, token: int) -> None:
        await self.fence.set(self.client, key, value, token)  # G8: one Lua call

    async def write_with(self, write: FencedWrite, key: str, value: str) -> None:
        await write.redis_set(self.client, key, value)

    async def read(self, key: str) -> tuple[str | None, int | None]:
        return await self.client.get(key), await self.fence.current(self.client, key)


@pytest.fixture(params=STORES)
def store_spec(request: pytest.FixtureRequest) -> str:
    """Which store (a ``*_spec`` parameter, so ``--backend redis`` selects by it)."""
    name: str = request.param
    return name


@pytest.fixture
def store(store_spec: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if store_spec == "sqlite":
        return SqliteStore(tmp_path / "items.db")
    if store_spec == "postgres":
        pg: PgServer = request.getfixturevalue("pg_server")
        return PostgresStore(pg.url())
    server: RedisServer = request.getfixturevalue("redis_server")
    return RedisStore(server.url)


class Gates:
    """Per-token points a write reaches before it goes to the store, opened by the test."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[threading.Event, threading.Event]] = {}

    def hold(self, token: int) -> tuple[threading.Event, threading.Event]:
        self.held[token] = (threading.Event(), threading.Event())
        return self.held[token]

    async def passage(self, token: int) -> None:
        gate = self.held.get(token)
        if gate is not None:
            arrived, opened = gate
            arrived.set()
            await anyio.to_thread.run_sync(opened.wait, 30, abandon_on_cancel=True)


def service(store: Store, gates: Gates | None = None) -> FastAPI:
    """The protected resource: PUT writes through the fence, GET reads back."""
    gates = gates or Gates()
    app = install(FastAPI(lifespan=store.lifespan))

    @app.put("/items/{key}")
    async def put(key: str, item: Item, token: int = Depends(fencing_token)) -> int:
        await gates.passage(token)
        await store.write(key, item.value, token)  # StaleToken -> 412 (install)
        return token

    @app.put("/other-header/{key}")
    async def put_other(
        key: str, item: Item, token: int = Depends(FencingToken("X-Ledger-Fence"))
    ) -> int:
        await store.write(key, item.value, token)
        return token

    @app.put("/helper/{key}")
    async def put_helper(key: str, item: Item, write: FencedWrite = Depends(fenced_write)) -> int:
        await store.write_with(write, key, item.value)
        return write.token

    @app.get("/items/{key}")
    async def get(key: str) -> dict[str, Any]:
        value, mark = await store.read(key)
        return {"value": value, "mark": mark}

    return app


async def test_stale_missing_and_malformed_tokens_are_refused_and_nothing_is_written(
    store: Store, lock_name: str
) -> None:
    with recording_logs() as logs, serving(service(store)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            url = f"/items/{lock_name}"
            ok = await client.put(url, json={"value": "v7"}, headers={"Fencing-Token": "7"})
            assert ok.status_code == 200 and ok.json() == 7
            again = await client.put(url, json={"value": "v7b"}, headers={"Fencing-Token": "7"})
            assert again.status_code == 200  # equal tokens pass: the same holder again
            expected = {"value": "v7b", "mark": 7}

            stale = await client.put(url, json={"value": "old"}, headers={"Fencing-Token": "6"})
            assert stale.status_code == 412
            assert (
                stale.json()["current"] == 7 and "stale fencing token 6" in stale.json()["detail"]
            )
            assert (await client.get(url)).json() == expected

            missing = await client.put(url, json={"value": "none"})
            assert missing.status_code == 428
            assert "Fencing-Token header" in missing.json()["detail"]
            assert (await client.get(url)).json() == expected

            # Past Python's int-string limit (4,300 digits) int() itself raises: the
            # header is checked before it is converted, and any client may send it.
            huge = ["9" * 5000, "1" + "0" * 20_000, "0" * 5000 + "0"]
            bad_tokens = ["abc", "-1", "0", "1.5", "", "1e3", "0x10", "9" * 30, str(2**63), *huge]
            for bad in bad_tokens:
                answer = await client.put(url, json={"value": bad}, headers={"Fencing-Token": bad})
                assert answer.status_code == 400, bad[:50]
                assert "positive integer" in answer.json()["detail"]
                assert len(answer.json()["detail"]) < 300  # a long header is not echoed back
            assert logs.tracebacks() == []
            twice = await client.put(
                url,
                json={"value": "twice"},
                headers=[("Fencing-Token", "8"), ("Fencing-Token", "9")],
            )
            assert twice.status_code == 400
            assert (await client.get(url)).json() == expected

            helper = f"/helper/{lock_name}"
            assert (await client.put(helper, json={"value": "h"})).status_code == 428
            malformed = await client.put(
                helper, json={"value": "h"}, headers={"Fencing-Token": "x"}
            )
            assert malformed.status_code == 400
            stale_helper = await client.put(
                helper, json={"value": "h"}, headers={"Fencing-Token": "6"}
            )
            assert stale_helper.status_code == 412
            assert (await client.get(url)).json() == expected

            other = f"/other-header/{lock_name}"
            assert (await client.put(other, json={"value": "x"})).status_code == 428
            stale_other = await client.put(
                other, json={"value": "old"}, headers={"X-Ledger-Fence": "3"}
            )
            assert stale_other.status_code == 412
            assert (await client.get(url)).json() == expected

            newer = await client.put(helper, json={"value": "v8"}, headers={"Fencing-Token": "8"})
            assert newer.status_code == 200 and newer.json() == 8
            assert (await client.get(url)).json() == {"value": "v8", "mark": 8}
            padded = "0" * 5000 + "9"  # leading zeros do not count: token 9
            nine = await client.put(url, json={"value": "v9"}, headers={"Fencing-Token": padded})
            assert nine.status_code == 200 and nine.json() == 9


async def test_two_writers_6_then_5_the_late_5_is_refused(store: Store, lock_name: str) -> None:
    """Writers 5 and 6 race: 5 is let through to the fence only after 6 wrote."""
    gates = Gates()
    arrived5, open5 = gates.hold(5)
    with serving(service(store, gates)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            url = f"/items/{lock_name}"
            late: list[httpx.Response] = []

            async def writer5() -> None:
                late.append(
                    await client.put(url, json={"value": "five"}, headers={"Fencing-Token": "5"})
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(writer5)
                await wait_thread_event(arrived5)  # 5 is in the service, before its write
                six = await client.put(url, json={"value": "six"}, headers={"Fencing-Token": "6"})
                assert six.status_code == 200
                open5.set()
            assert late[0].status_code == 412
            assert (await client.get(url)).json() == {"value": "six", "mark": 6}


async def test_without_the_atomic_fence_the_same_race_lets_5_overwrite_6(
    tmp_path: Path, lock_name: str
) -> None:
    """The counterexample: check first, write later, and writer 5 wins the race."""
    store = SqliteStore(tmp_path / "naive.db")
    arrived, opened = threading.Event(), threading.Event()
    app = install(FastAPI(lifespan=store.lifespan))

    @app.put("/naive/{key}")
    async def put(key: str, item: Item, token: int = Depends(fencing_token)) -> int:
        async def pause() -> None:
            if token == 5:
                arrived.set()
                await anyio.to_thread.run_sync(opened.wait, 30, abandon_on_cancel=True)

        await store.naive_write(key, item.value, token, pause)
        return token

    with serving(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            url = f"/naive/{lock_name}"
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: client.put(url, json={"value": "five"}, headers={"Fencing-Token": "5"})
                )
                await wait_thread_event(arrived)  # 5 passed its check, has not written
                six = await client.put(url, json={"value": "six"}, headers={"Fencing-Token": "6"})
                assert six.status_code == 200
                opened.set()
    assert await store.read(lock_name) == ("five", 5)  # the stale writer overwrote 6


async def test_openapi_documents_the_header_and_412_428(tmp_path: Path) -> None:
    with serving(service(SqliteStore(tmp_path / "doc.db"))) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/items/{key}"]["put"]
    assert {"400", "412", "428"} <= set(operation["responses"])
    header = [p for p in operation["parameters"] if p["in"] == "header"]
    assert [p["name"] for p in header] == ["Fencing-Token"]
    other = schema["paths"]["/other-header/{key}"]["put"]
    assert [p["name"] for p in other["parameters"] if p["in"] == "header"] == ["X-Ledger-Fence"]
    assert "412" not in schema["paths"]["/items/{key}"]["get"]["responses"]
    helper = schema["paths"]["/helper/{key}"]["put"]
    assert {"400", "412", "428"} <= set(helper["responses"])
    assert [p["name"] for p in helper["parameters"] if p["in"] == "header"] == ["Fencing-Token"]


def holder(url: str, service_url: str, before_send: Callable[[], None]) -> FastAPI:
    """A guarded route that writes to the fenced service with the guard's token."""
    locks = Locks(url)
    app = install(FastAPI(lifespan=locks.lifespan))
    app.state.service_answers = []

    @app.post("/sync/{key}")
    @locks.guard("sync:{key}", ttl=1)
    async def sync(key: str, lease: asynclock.Lease = Depends(current_lease)) -> int:
        async def hook(request: httpx.Request) -> None:
            before_send()  # runs after FencingAuth put the token on the request

        async with httpx.AsyncClient(
            base_url=service_url, auth=FencingAuth(), event_hooks={"request": [hook]}, timeout=30
        ) as client:
            # Shielded: the request leaves even if the loss is noticed meanwhile, like a
            # packet already on the wire when a paused process resumes.
            with anyio.CancelScope(shield=True):
                answer = await client.put(f"/items/{key}", json={"value": f"holder {lease.token}"})
            app.state.service_answers.append(answer.status_code)
        return lease.token

    return app


async def test_fencing_auth_end_to_end_a_frozen_holders_late_call_is_412(
    redis_server: RedisServer, tmp_path: Path, lock_name: str
) -> None:
    store = SqliteStore(tmp_path / "ledger.db")
    freeze_next, frozen, thaw = threading.Event(), threading.Event(), threading.Event()

    def before_send() -> None:
        if freeze_next.is_set():
            frozen.set()
            thaw.wait(30)  # blocks the holder's whole event loop: renewals stop too

    with recording_logs() as logs, serving(service(store)) as ledger:
        holder_app = holder(redis_server.url, ledger.url, before_send)
        holder_server = ServerThread(holder_app).start()
        try:
            async with httpx.AsyncClient(base_url=holder_server.url, timeout=30) as client:
                first = await client.post(f"/sync/{lock_name}")
                assert first.status_code == 200
                assert holder_app.state.service_answers == [200]
                token = first.json()
                assert (await store.read(lock_name)) == (f"holder {token}", token)

                freeze_next.set()
                late: list[httpx.Response] = []

                async def call() -> None:
                    late.append(await client.post(f"/sync/{lock_name}"))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    await wait_thread_event(frozen)
                    # The holder's lease runs out at Redis while it is frozen; a successor
                    # takes the lock and writes with its newer token.
                    async with (
                        asynclock.connect(redis_server.url) as backend,
                        backend.lock(f"sync:{lock_name}", ttl=5, timeout=20) as successor,
                        httpx.AsyncClient(base_url=ledger.url, auth=FencingAuth()) as direct,
                    ):
                        wrote = await direct.put(f"/items/{lock_name}", json={"value": "successor"})
                        assert wrote.status_code == 200
                        assert successor.token > token + 1
                    thaw.set()
        finally:
            thaw.set()
            holder_server.stop()
    assert holder_app.state.service_answers == [200, 412]  # the late call was refused
    assert late[0].status_code == 503  # and the holder's request was stopped
    value, mark = await store.read(lock_name)
    assert value == "successor" and mark == successor.token
    assert logs.tracebacks() == []


def _process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_fencing_auth_end_to_end_a_sigstopped_holders_late_call_is_412(
    redis_server: RedisServer, tmp_path: Path, lock_name: str
) -> None:
    """The same story with a real process freeze: the holder runs in its own uvicorn
    process and SIGSTOPs itself with the token on its outgoing request."""
    store = SqliteStore(tmp_path / "ledger.db")
    app = service(store)
    seen: list[tuple[str | None, int]] = []  # (token header, status) of each ledger write

    @app.middleware("http")
    async def record(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        if request.method == "PUT":
            seen.append((request.headers.get("Fencing-Token"), response.status_code))
        return response

    port = free_port()
    log = tmp_path / "holder.log"
    with serving(app) as ledger, log.open("wb") as log_file:
        holder = _start_holder(redis_server.url, ledger.url, port, log_file)
        try:
            await wait_until(lambda: _port_open(port), timeout=30)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                first = await client.post(f"/sync/{lock_name}")
                assert first.status_code == 200 and first.json()["ledger"] == 200
                late: list[httpx.Response] = []

                async def call() -> None:
                    late.append(await client.post(f"/sync/{lock_name}", params={"freeze": "true"}))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    await wait_until(lambda: _process_state(holder.pid) == "T", timeout=20)
                    async with (
                        asynclock.connect(redis_server.url) as backend,
                        backend.lock(f"sync:{lock_name}", ttl=5, timeout=20) as successor,
                        httpx.AsyncClient(base_url=ledger.url, auth=FencingAuth()) as direct,
                    ):
                        wrote = await direct.put(f"/items/{lock_name}", json={"value": "successor"})
                        assert wrote.status_code == 200
                    os.kill(holder.pid, signal.SIGCONT)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
            holder.terminate()
            holder.wait(30)
    frozen_token = str(first.json()["token"] + 1)
    assert seen == [
        (str(first.json()["token"]), 200),
        (str(successor.token), 200),
        (frozen_token, 412),  # the frozen holder's late write, refused by the fence
    ]
    assert late[0].status_code == 503
    value, mark = await store.read(lock_name)
    assert value == "successor" and mark == successor.token
    output = log.read_bytes().decode()
    assert "Traceback" not in output and "CancelledError" not in output, output


def _start_holder(lock_url: str, ledger_url: str, port: int, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.fastapi_holder", lock_url, ledger_url, str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_fencing_auth_without_a_lease_and_with_a_lost_one() -> None:
    auth = FencingAuth()
    request = httpx.Request("PUT", "http://ledger/items/1")
    with pytest.raises(LookupError):
        next(auth.auth_flow(request))
    async with asynclock.testing.memory_backend() as backend:
        async with backend.lock("x", ttl=5) as lease:
            sent = next(FencingAuth(header="X-Fence").auth_flow(request))
            assert sent.headers["X-Fence"] == str(lease.token)
        with pytest.raises(asynclock.LeaseLost):
            next(FencingAuth(lease).auth_flow(request))  # released: refuse to send
