"""The one place asynclock leans on redis-py's private API: ``Wire`` reads replies from a
connection's ``_reader`` stream and writes to its ``_writer`` (asynclock.backends.redis.wire).

If redis-py renames or retypes them, the driver silently falls back to the public (slower)
path; these tests are what notice.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

import asynclock
from asynclock.backends.redis import RedisDriver
from asynclock.backends.redis.wire import Wire
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.anyio


async def test_redis_py_connections_still_expose_the_streams_wire_reads(
    redis_server: RedisServer,
) -> None:
    """A connected redis-py connection has ``_reader``/``_writer`` asyncio streams."""
    with anyio.fail_after(30):
        async with asynclock.connect(redis_server.url) as backend:
            driver = backend.driver
            assert isinstance(driver, RedisDriver)
            conn = driver.node.make_connection()
            await conn.connect()  # type: ignore[no-untyped-call]
            try:
                assert isinstance(getattr(conn, "_reader", None), asyncio.StreamReader)
                assert isinstance(getattr(conn, "_writer", None), asyncio.StreamWriter)
                assert getattr(conn, "protocol", None) == 2
            finally:
                await conn.disconnect()


async def test_the_driver_takes_the_lean_path(redis_server: RedisServer, lock_name: str) -> None:
    """With hiredis and RESP2, every idle connection parses its replies itself."""
    with anyio.fail_after(30):
        async with asynclock.connect(redis_server.url) as backend:
            driver = backend.driver
            assert isinstance(driver, RedisDriver)
            async with backend.lock(lock_name, ttl=5.0):
                pass
            wires: list[Wire] = driver.node._idle
            assert wires
            for wire in wires:
                assert wire.writer is not None and wire.stream is not None
                assert wire.parser is not None
