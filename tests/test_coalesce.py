"""backends/_common/coalesce.py: calls made while one is in flight go out together, each
caller gets its own answer, and one caller's cancellation touches nobody else's call
(the withdrawn PostgreSQL batching sent a batch from a caller's task, see the module)."""

from __future__ import annotations

import asyncio

import pytest

from asynclock import BackendUnavailable
from asynclock.backends._common.coalesce import Coalesced

pytestmark = pytest.mark.anyio


class Server:
    """Answers ``one`` and ``many`` calls once let go; records what each call carried."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None

    async def one(self, item: str) -> str:
        self.calls.append([item])
        await self.gate.wait()
        return f"ok {item}"

    async def many(self, items: list[str]) -> list[str | BaseException]:
        self.calls.append(list(items))
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [ValueError(item) if item.startswith("bad") else f"ok {item}" for item in items]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_calls_made_while_one_is_in_flight_go_out_together() -> None:
    server = Server()
    calls = Coalesced(server.one, server.many, limit=3, what="test: release")
    first = asyncio.ensure_future(calls("a", "a"))
    await settle()
    rest = [asyncio.ensure_future(calls(k, k)) for k in ["b", "c", "b", "d", "bad"]]
    await settle()
    server.gate.set()
    assert await asyncio.wait_for(first, 5) == "ok a"
    answers = await asyncio.wait_for(asyncio.gather(*rest, return_exceptions=True), 5)
    # One call alone, then batches of at most 3 with one call per key (the second "b"
    # waits for the next batch, in its place); each caller has its own answer.
    assert server.calls == [["a"], ["b", "c", "d"], ["b", "bad"]]
    assert answers[:4] == ["ok b", "ok c", "ok b", "ok d"]
    assert isinstance(answers[4], ValueError)
    assert calls.batches == 2


async def test_a_cancelled_caller_is_never_sent_and_cuts_nobody_short() -> None:
    server = Server()
    calls = Coalesced(server.one, server.many, limit=10, what="test: release")
    first = asyncio.ensure_future(calls("a", "a"))
    await settle()
    in_flight = asyncio.ensure_future(calls("b", "b"))
    await settle()  # the pump sends "b" at once, alone
    queued = [asyncio.ensure_future(calls(k, k)) for k in ["c", "d"]]
    await settle()  # behind "b"'s batch
    in_flight.cancel()  # its batch is sent: the pump answers the others anyway
    queued[0].cancel()  # not sent yet: it never is
    await settle()
    server.gate.set()
    assert await asyncio.wait_for(first, 5) == "ok a"
    assert await asyncio.wait_for(queued[1], 5) == "ok d"
    assert in_flight.cancelled() and queued[0].cancelled()
    assert server.calls == [["a"], ["b"], ["d"]]


async def test_a_failed_batch_fails_each_of_its_callers_with_an_error_of_its_own() -> None:
    server = Server()
    server.fail = ConnectionError("the server went away (test)")
    calls = Coalesced(server.one, server.many, limit=10, what="test: release")
    first = asyncio.ensure_future(calls("a", "a"))
    await settle()
    rest = [asyncio.ensure_future(calls(k, k)) for k in ["b", "c"]]
    await settle()
    server.gate.set()
    await asyncio.wait_for(first, 5)
    errors = await asyncio.wait_for(asyncio.gather(*rest, return_exceptions=True), 5)
    assert all(isinstance(e, BackendUnavailable) for e in errors)
    assert errors[0] is not errors[1]
    assert "test: release failed: ConnectionError" in str(errors[0])


async def test_closing_fails_the_queue_and_refuses_new_calls() -> None:
    server = Server()
    calls = Coalesced(server.one, server.many, limit=10, what="test: release")
    first = asyncio.ensure_future(calls("a", "a"))
    await settle()
    queued = asyncio.ensure_future(calls("b", "b"))
    await settle()
    calls.close("test was closed")  # "b" is in flight in the pump: cut short
    with pytest.raises(BackendUnavailable, match="test was closed"):
        await asyncio.wait_for(queued, 5)
    with pytest.raises(BackendUnavailable, match="test was closed"):
        await calls("c", "c")
    first.cancel()
