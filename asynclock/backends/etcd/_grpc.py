"""Waiting for grpc.aio calls and tasks through anyio events, never awaiting them directly.

grpc.aio and anyio cancellation (grpc/grpc#43502): when an anyio cancel scope cancels a
task that awaits a grpc.aio call, grpc swallows the cancellation and raises a fresh, bare
``CancelledError`` that anyio cannot match to its scope, so it escapes ``move_on_after``.
No grpc.aio awaitable is ever awaited directly in this package: a unary call is waited for
through an ``anyio.Event`` set by the call's done-callback (cancelling the wait cancels the
RPC; the result is read once the call is done, without a suspension), and stream reads and
writes run in their own asyncio tasks whose completion is waited for the same way (the
helpers below). Only the client and these helpers touch grpc or asyncio; the driver never.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def settle(
    aw: Awaitable[T], *, cancel: bool = True, inflight: set[asyncio.Future[Any]] | None = None
) -> T:
    """Await a grpc.aio awaitable in its own task (see the module docstring). If we are
    cancelled, the task is cancelled too unless ``cancel`` is false (it then runs on, and
    closing the client waits for it)."""
    task = start(aw, inflight)
    done = anyio.Event()
    task.add_done_callback(lambda _t: done.set())
    try:
        await done.wait()
    except BaseException:
        if cancel:
            task.cancel()
        raise
    return task.result()


def start(aw: Awaitable[T], inflight: set[asyncio.Future[Any]] | None = None) -> asyncio.Future[T]:
    """``aw`` in a task of its own. Its error is always retrieved: a call left behind (a
    stream write whose etcd went away while nobody awaited it any more) is not logged by
    asyncio as "Task exception was never retrieved"."""
    task = asyncio.ensure_future(aw)
    task.add_done_callback(_retrieve)
    if inflight is not None:
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    return task


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def end_stream(call: Any, reading: asyncio.Future[Any] | None) -> None:
    """Cancel ``call`` and wait until grpc has finished with it (bounded): a completion
    that arrives after its event loop closed breaks the next loop grpc serves."""
    if not call.done():
        call.cancel()
    with anyio.move_on_after(1.0):
        if reading is not None:
            await wait_done(reading)
        await wait_call(call)


async def wait_done(task: asyncio.Future[Any]) -> None:
    if not task.done():
        done = anyio.Event()
        task.add_done_callback(lambda _t: done.set())
        await done.wait()
    if not task.cancelled():
        task.exception()  # retrieved: never "exception was never retrieved"


async def wait_call(call: Any) -> None:
    if not call.done():
        done = anyio.Event()
        call.add_done_callback(lambda _c: done.set())
        await done.wait()


def serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data
