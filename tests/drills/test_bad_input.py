"""Bad-input sweep (Hypothesis) on every backend: a clear exception, never a hang, never a write.

Names are drawn from all of Unicode (NUL, lone surrogates, glob/Lua/SQL metacharacters,
strings past 512 UTF-8 bytes), ttl and timeout from the numbers people get wrong (0,
negative, NaN, inf, huge, a bool, a str). For every draw the backend must either take the
lock and give it back (a valid name is any non-empty str up to 512 UTF-8 bytes; it is
data, never syntax) or raise ``ValueError``/``TypeError`` saying what was wrong — before
any driver call (counted through :class:`asynclock.testing.DriverFaults`), within a bound.
Malformed URLs raise from ``connect()``, which does no I/O.

One backend is opened per parameter and driven from Hypothesis' examples through a
blocking portal, so a few hundred examples per backend take about a second.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynclock
from asynclock._core.validation import MAX_TTL
from asynclock.testing import DriverFaults
from tests.support.spec import BackendSpec

DRIVER_CALLS = ("acquire", "extend", "release", "validate", "holder", "break_lock", "watch")
METACHARACTERS = [
    "*",
    "?",
    "[a-z]",
    "{x}",
    "%",
    "_",
    "'",
    '"',
    ";",
    "--",
    "\\",
    "$1",
    "..",
    "'; DROP TABLE asynclock_lease; --",
    "]]..[[",
    "KEYS[1]",
    "\x00",
    "\n",
]
BOUND = 10.0

names = st.one_of(
    st.text(max_size=40),
    st.text(min_size=100, max_size=300),  # around the 512-byte limit in UTF-8
    st.lists(st.sampled_from(METACHARACTERS), min_size=1, max_size=8).map("".join),
    st.integers(min_value=500, max_value=530).map(lambda n: "x" * n),
    st.sampled_from(["", "\x00", "\ud800", "é" * 256, "é" * 257, None, 42, b"bytes"]),
)
seconds = st.sampled_from(
    [
        0,
        0.0,
        -1,
        -0.001,
        math.nan,
        math.inf,
        -math.inf,
        1e300,
        2**64,
        MAX_TTL,
        MAX_TTL + 1,
        True,
        "1",
        None,
        0.5,
        5,
    ]
)


def valid_name(name: object) -> bool:
    if not isinstance(name, str):
        return False
    try:
        return 0 < len(name.encode("utf-8")) <= 512
    except UnicodeEncodeError:  # a lone surrogate
        return False


def valid_ttl(ttl: object) -> bool:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        return False
    return 0 < ttl <= MAX_TTL  # NaN fails both comparisons


def valid_timeout(timeout: object) -> bool:
    if timeout is None:
        return True
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return False
    return not math.isnan(timeout) and timeout >= 0


class Session:
    """One open backend, its driver calls counted."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal, backend: Any) -> None:
        self.portal, self.backend, self.calls = portal, backend, 0
        self.faults = DriverFaults(backend)

        async def counting(call: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await call(*args, **kwargs)

        for method in DRIVER_CALLS:
            self.faults.around(method, counting)

    async def attempt(self, name: Any, ttl: Any, timeout: Any) -> BaseException | None:
        with anyio.fail_after(BOUND):
            try:
                async with self.backend.lock(name, ttl=ttl, timeout=timeout):
                    pass
            except (ValueError, TypeError) as exc:
                return exc
        return None


@pytest.fixture(scope="module")
def portal() -> Iterator[anyio.from_thread.BlockingPortal]:
    with anyio.from_thread.start_blocking_portal() as portal:
        yield portal


@pytest.fixture
def session(spec: BackendSpec, portal: anyio.from_thread.BlockingPortal) -> Iterator[Session]:
    with portal.wrap_async_context_manager(spec.connect()) as backend:
        yield Session(portal, backend)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=names, ttl=seconds, timeout=seconds)
def test_every_bad_argument_raises_before_any_io(
    session: Session, name: Any, ttl: Any, timeout: Any
) -> None:
    before = session.calls
    error = session.portal.call(session.attempt, name, ttl, timeout)
    if valid_name(name) and valid_ttl(ttl) and valid_timeout(timeout):
        assert error is None, f"{name!r} ttl={ttl!r} timeout={timeout!r}: {error!r}"
        assert session.calls > before
        return
    assert error is not None, f"{name!r} ttl={ttl!r} timeout={timeout!r} was accepted"
    assert str(error), "an error without a message"
    assert session.calls == before, f"{error!r} came after {session.calls - before} driver call(s)"


@pytest.mark.parametrize(
    "url",
    [
        "", "redis", "://x", "redis://:notaport", "redis://127.0.0.1:99999/0", "redlock://",
        "redlock://127.0.0.1:1,127.0.0.1:1", "sqlite://", "sqlite:///x.db?timeout=nan",
        "postgresql://h/db?mode=nope", "postgresql://h/db?poll=-1", "ftp://example.com",
    ],
)  # fmt: skip
def test_malformed_urls_raise_clearly_without_io(url: str) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        asynclock.connect(url)
    assert len(str(caught.value)) > 10


def test_a_url_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="url must be a str"):
        asynclock.connect(b"redis://127.0.0.1:6379/0")  # type: ignore[arg-type]
