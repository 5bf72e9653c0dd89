"""``@backend.locked_function(template, ttl=...)``: refused at decoration when it cannot work.

The lock behaviour itself runs on every backend in tests/conformance/test_holder_extend_break.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing

pytestmark = pytest.mark.anyio


def test_sync_function_is_refused() -> None:
    backend = asynclock.testing.memory_backend()

    def report(customer_id: int) -> None:
        pass

    with pytest.raises(TypeError, match=r"async def.*report is not async"):
        backend.locked_function("report:{customer_id}", ttl=5.0)(report)  # type: ignore[arg-type]


def test_async_generator_is_refused() -> None:
    backend = asynclock.testing.memory_backend()

    async def rows(customer_id: int) -> AsyncIterator[int]:
        yield customer_id

    with pytest.raises(TypeError, match="async generator"):
        backend.locked_function("report:{customer_id}", ttl=5.0)(rows)  # type: ignore[arg-type]


def test_template_naming_a_missing_argument_is_refused_at_decoration() -> None:
    backend = asynclock.testing.memory_backend()

    async def report(customer_id: int) -> None:
        pass

    with pytest.raises(TypeError, match=r"uses customer, which .*report\(\) does not take"):
        backend.locked_function("report:{customer}", ttl=5.0)(report)


@pytest.mark.parametrize(
    ("template", "kwargs", "error", "words"),
    [
        ("report:{", {"ttl": 5.0}, ValueError, "malformed"),
        ("report:{0}", {"ttl": 5.0}, ValueError, "positional"),
        ("", {"ttl": 5.0}, ValueError, "non-empty"),
        (42, {"ttl": 5.0}, TypeError, "must be a str"),
        ("report", {"ttl": 0}, ValueError, "ttl must be"),
        ("report", {"ttl": 5.0, "timeout": -1}, ValueError, "timeout"),
        ("report", {"ttl": 5.0, "max_hold": "x"}, TypeError, "max_hold"),
    ],
)
def test_bad_template_or_lock_arguments_fail_at_decoration(
    template: Any, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    backend = asynclock.testing.memory_backend()
    with pytest.raises(error, match=words):
        backend.locked_function(template, **kwargs)


async def test_methods_kwargs_defaults_and_bad_calls() -> None:
    backend = asynclock.testing.memory_backend()

    class Account:
        def __init__(self, number: int) -> None:
            self.number = number

        @backend.locked_function("account:{self.number}:{kind}", ttl=5.0)
        async def close(self, kind: str = "normal") -> str:
            return asynclock.current_lease().name

    @backend.locked_function("job:{queue}", ttl=5.0)
    async def run(**options: Any) -> str:
        return asynclock.current_lease().name

    async with backend:
        assert await Account(7).close() == "account:7:normal"
        assert await Account(7).close(kind="final") == "account:7:final"
        assert await run(queue="mail") == "job:mail"
        with pytest.raises(TypeError):
            await Account(7).close("a", "b")  # type: ignore[call-arg]
        assert backend.stats().acquired == 3  # the bad call never took a lock


async def test_a_lost_lease_cancels_the_call_and_raises() -> None:
    backend = asynclock.testing.memory_backend()
    reached = False

    @backend.locked_function("nightly:{day}", ttl=5.0)
    async def nightly(day: str) -> None:
        nonlocal reached
        asynclock.testing.force_loss(asynclock.current_lease(), "test")
        await anyio.sleep_forever()
        reached = True  # pragma: no cover

    async with backend:
        with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost, match="test"):
            await nightly("2026-12-01")
    assert not reached
