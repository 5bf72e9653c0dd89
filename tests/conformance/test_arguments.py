"""Bad input fails fast with a message that says what was wrong and what is allowed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynclock
from tests.conftest import BACKENDS
from tests.support.checks import check_max_ttl
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("", ValueError, "non-empty"),
        ("x" * 513, ValueError, "at most 512"),
        ("é" * 257, ValueError, "514 UTF-8 bytes"),
        ("a\ud800b", ValueError, "lone surrogate .* at index 1"),
        ("\udfff", ValueError, "encodable as UTF-8"),
        ("x" * 300 + "\ud83d", ValueError, "lone surrogate"),
        (b"bytes", TypeError, "must be a str"),
        (42, TypeError, "must be a str"),
        (None, TypeError, "must be a str"),
    ],
)
async def test_bad_names(
    backend: asynclock.Backend, name: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        backend.lock(name, ttl=1.0)
    with pytest.raises(error, match=words):
        await backend.acquire(name, ttl=1.0)
    with pytest.raises(error, match=words):
        await backend.validate(name, 1)


async def test_longest_allowed_name_works(backend: asynclock.Backend) -> None:
    async with backend.lock("n" * 512, ttl=5.0) as lease:
        assert lease.name == "n" * 512


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"ttl": 0}, ValueError, "> 0"),
        ({"ttl": -1.5}, ValueError, "> 0"),
        ({"ttl": math.nan}, ValueError, "not NaN"),
        ({"ttl": math.inf}, ValueError, "finite"),
        ({"ttl": "5"}, TypeError, "number of seconds"),
        ({"ttl": True}, TypeError, "number of seconds"),
        ({"ttl": 1.0, "timeout": -1}, ValueError, ">= 0"),
        ({"ttl": 1.0, "timeout": math.nan}, ValueError, "NaN"),
        ({"ttl": 1.0, "blocking": False, "timeout": 1}, ValueError, "blocking=True"),
        ({"ttl": 1.0, "blocking": "no"}, TypeError, "True or False"),
        ({"ttl": 1.0, "max_hold": 0}, ValueError, "max_hold"),
        ({"ttl": asynclock.MAX_TTL + 1}, ValueError, "at most 604800 seconds"),
        ({"ttl": 1e300}, ValueError, "at most 604800 seconds"),
        ({"ttl": 30 * 24 * 3600, "timeout": 1.0}, ValueError, "at most 604800 seconds"),
    ],
)
async def test_bad_lock_arguments(
    backend: asynclock.Backend, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        backend.lock("x", **kwargs)


@pytest.mark.parametrize("ttl", [asynclock.MAX_TTL + 0.5, 1e300, 2**70])
async def test_huge_ttl_is_refused_before_any_io(backend: asynclock.Backend, ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
        await backend.acquire("x", ttl=ttl)
    with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
        async with backend.lock("x", ttl=ttl, blocking=False):
            pass  # pragma: no cover
    async with backend.lock("x", ttl=5.0) as lease:
        with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
            await lease.extend(ttl)
        lease.check()
    # A leadership term is a lease: refused at the call, as lock() is (it granted a term
    # that never expired on memory/sqlite and hung on redis/redlock).
    with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
        backend.leadership("x", ttl=ttl)
    with pytest.raises(ValueError, match="ttl must be at most 604800 seconds"):
        backend.leadership("x", ttl=ttl, identity="node-a")


# Not postgres_lease here: the lease table durably keeps the longest ttl ever granted (the
# crash grace), which must not become 7 days on the shared server; tests/backends/
# test_postgres.py checks both PostgreSQL modes on a database of their own.
# (A fixture named *_spec: --backend/-m select it like the conformance `spec` fixture.)
@pytest.fixture(params=[b for b in BACKENDS if b != "postgres_lease"])
def long_ttl_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


async def test_longest_allowed_ttl_works(long_ttl_spec: BackendSpec, lock_name: str) -> None:
    """Every backend honours MAX_TTL (PostgreSQL's idle_session_timeout is an int of ms)."""
    assert asynclock.MAX_TTL == 7 * 24 * 3600
    async with long_ttl_spec.connect() as backend:
        await check_max_ttl(backend, lock_name)


async def test_a_lone_surrogate_name_is_refused_before_any_io(
    backend: asynclock.Backend,
) -> None:
    for name in ("\ud800", "ok\udfffok", "é\udc80"):
        with pytest.raises(ValueError, match="lone surrogate"):
            await backend.acquire(name, ttl=1.0)
        with pytest.raises(ValueError, match="lone surrogate"):
            await backend.validate(name, 1)
    async with backend.lock("é😀ok", ttl=5.0) as lease:  # any other str is fine
        assert lease.name == "é😀ok"


ASCII = st.characters(max_codepoint=0x7F)
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
CHARS = st.one_of(ASCII, st.characters(), SURROGATES)


@settings(max_examples=300, deadline=None)
@given(
    name=st.one_of(
        st.text(max_size=200),
        st.text(alphabet=CHARS, max_size=140),
        st.builds(str.__add__, st.text(alphabet=ASCII, min_size=124, max_size=130), st.text(CHARS)),
        st.sampled_from(["", "x" * 128, "x" * 129, "é" * 128, "\ud800", "x" * 512, "x" * 513]),
    ),
    ttl=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([asynclock.MAX_TTL, asynclock.MAX_TTL + 1e-6, 5e-324, 0.0, -0.0]),
    ),
)
def test_fast_path_and_validators_agree(name: str, ttl: float) -> None:
    """``backend.lock(name, ttl=...)`` takes a fast path; passing ``timeout`` takes the
    full validators: both accept the same (name, ttl) and refuse the rest alike."""
    backend = asynclock.connect("memory://")

    def outcome(**extra: Any) -> tuple[str, Any]:
        try:
            lock = backend.lock(name, ttl=ttl, **extra)
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return "ok", (lock.name, repr(lock))

    assert outcome() == outcome(timeout=math.inf)


async def test_ttl_too_short_for_margin(backend: asynclock.Backend) -> None:
    with pytest.raises(ValueError, match="leaves no time"):
        await backend.acquire("x", ttl=0.001)


@pytest.mark.parametrize(
    ("token", "error", "words"),
    [
        (0, ValueError, r"positive 64-bit int \(1 to 2\*\*63 - 1, .*\), got 0$"),
        (-3, ValueError, r"positive 64-bit int \(1 to 2\*\*63 - 1, .*\), got -3$"),
        (2**63, ValueError, r"got 9223372036854775808$"),
        (10**5000, ValueError, r"got an int of 16610 bits$"),  # not str(): over 4,300 digits
        ("1", TypeError, "fencing token must be an int, not str"),
        (True, TypeError, "fencing token must be an int, not bool"),
    ],
    ids=["0", "-3", "2**63", "10**5000", "str", "bool"],
)
async def test_bad_tokens(
    backend: asynclock.Backend, token: Any, error: type[Exception], words: str
) -> None:
    """validate() refuses a value no lease can have (the docs say so: ValueError or
    TypeError, as the fences do); False is the answer for a token that is just not the
    live holder's."""
    with pytest.raises(error, match=words):
        await backend.validate("x", token)
    assert await backend.validate("x", 1) is False
    assert await backend.validate("x", 2**63 - 1) is False


def test_unknown_scheme_lists_allowed() -> None:
    with pytest.raises(ValueError, match=r"unknown backend URL scheme 'mysql'.*sqlite://"):
        asynclock.connect("mysql://localhost/db")
    with pytest.raises(ValueError, match="unknown backend URL scheme none"):
        asynclock.connect("/tmp/locks.db")
    with pytest.raises(TypeError, match="url must be a str"):
        asynclock.connect(Path("/tmp/x"))  # type: ignore[arg-type]


def test_bad_sqlite_urls() -> None:
    with pytest.raises(ValueError, match="needs a file path"):
        asynclock.connect("sqlite://")
    with pytest.raises(ValueError, match="memory://"):
        asynclock.connect("sqlite:///:memory:")
    with pytest.raises(ValueError, match="no host"):
        asynclock.connect("sqlite://host/locks.db")
    with pytest.raises(ValueError, match="allowed: synchronous, busy_timeout"):
        asynclock.connect("sqlite:///x.db?journal=off")
    with pytest.raises(ValueError, match="'normal' or 'full'"):
        asynclock.connect("sqlite:///x.db?synchronous=off")
    with pytest.raises(ValueError, match="busy_timeout must be a number"):
        asynclock.connect("sqlite:///x.db?busy_timeout=soon")


async def test_unreadable_sqlite_paths(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "locks.db"
    with pytest.raises(asynclock.BackendUnavailable, match="directory must exist"):
        async with asynclock.connect(f"sqlite:///{missing}"):
            pass
    with pytest.raises(asynclock.BackendUnavailable, match="it is a directory"):
        async with asynclock.connect(f"sqlite:///{tmp_path}"):
            pass
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "locks.db").write_bytes(b"this is not a database, just some bytes" * 100)
    with pytest.raises(asynclock.BackendUnavailable, match=r"locks\.db"):
        async with asynclock.connect(f"sqlite:///{garbage / 'locks.db'}"):
            pass


async def test_backend_must_be_open(backend: asynclock.Backend) -> None:
    closed = asynclock.connect("memory://")
    with pytest.raises(RuntimeError, match=r"async with asynclock\.connect"):
        await closed.acquire("x", ttl=1.0)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("memory://host", "memory:// takes no host, path or query options"),
        ("memory://?x=1", "memory:// takes no host, path or query options"),
        ("memory:///some/path", "use exactly 'memory://'"),
        ("sqlite:///x.db?foo=bar", "unknown sqlite:// URL option.*'foo'.*busy_timeout"),
        ("sqlite:///x.db?foo", "unknown sqlite:// URL option.*'foo'"),
        ("redis://localhost:6379/abc", r"redis:// URL path is the database number.*'abc'"),
        ("redis://localhost:6379/0/1", "database number"),
        ("rediss://localhost/x", "rediss:// URL path is the database number"),
        (
            "redis://localhost?foo=bar",
            "unknown redis:// URL option 'foo'; allowed: .*socket_timeout",
        ),
        ("redis://localhost?db=two", "db must be an integer"),
        ("redis://localhost/0?socket_timeout=-1", "socket_timeout must be .*> 0.*-1"),
        ("redis://localhost/0?socket_timeout=inf", "socket_timeout must be"),
        ("redis://localhost/0?socket_connect_timeout=-1", "socket_connect_timeout must be"),
        ("redis://localhost/0?connect_timeout=0", "connect_timeout must be"),
        ("redlock://a,b,c?socket_timeout=2", "sets each node's socket_timeout.*node_timeout"),
        ("redlock://a,b,c?node_timeout=-1", "node_timeout must be"),
        ("unix:///tmp/r.sock?foo=1", "unknown unix:// URL option 'foo'"),
        ("redis://localhost/0?decode_responses=True", "clashes with an option asynclock sets"),
        ("redlock://a,b,c/abc", "database"),
        ("redlock://a,b,c?foo=bar", "unknown redlock:// URL option 'foo'; allowed: .*node_timeout"),
        ("redlock://a,b,c?decode_responses=1", "clashes with an option asynclock sets"),
        ("postgresql://u@h/db?foo=bar", "unknown postgresql:// URL option 'foo'; allowed: .*mode"),
        ("postgres://u@h/db?idle_session_timeout=5", "clashes with a setting asynclock manages"),
        ("etcd://h:2379?foo=bar", "unknown etcd:// URL option 'foo'; allowed: .*prefix"),
    ],
)
def test_bad_urls_are_value_errors_at_connect(url: str, words: str) -> None:
    """A configuration error is a ValueError from connect() (no I/O yet), never a
    BackendUnavailable("connect failed") at open, and never silently ignored."""
    with pytest.raises(ValueError, match=words):
        asynclock.connect(url)


@pytest.mark.parametrize(
    ("url", "options", "error", "words"),
    [
        ("redis://localhost", {"decode_responses": True}, ValueError, "asynclock sets itself"),
        ("redlock://a,b,c", {"decode_responses": True}, ValueError, "asynclock sets itself"),
        ("sqlite:///x.db", {"journal": "off"}, TypeError, "unknown sqlite:// option 'journal'"),
        ("postgresql://u@h/db", {"pool": 3}, TypeError, "unknown postgresql:// option.*'pool'"),
        ("memory://", {"x": 1}, TypeError, "memory:// takes no options"),
        ("redis://localhost", {"foo": 1}, TypeError, "unknown redis:// option 'foo'; allowed"),
        ("redlock://a,b,c", {"foo": 1}, TypeError, "unknown redlock:// option 'foo'.*node_time"),
        ("etcd://h:2379", {"foo": 1}, TypeError, "unknown etcd:// option 'foo'; allowed: .*prefix"),
    ],
)
def test_bad_options_are_errors_at_connect(
    url: str, options: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        asynclock.connect(url, **options)


@pytest.mark.parametrize(
    "url",
    [
        "memory://",
        "memory:",
        "sqlite:///x.db?synchronous=full&busy_timeout=2",
        "redis://localhost:6379/0?protocol=3&socket_timeout=2&client_name=me",
        "redis://localhost:6379",
        "redis://localhost:6379/",
        "unix:///tmp/r.sock?db=3",
        "rediss://localhost/2?ssl_cert_reqs=none",
        "redlock://a,b,c/1?node_timeout=0.5&tls=1&prefix=app:",
        "redis://localhost/0?restart_grace=30",
        "redlock://a,b,c?restart_grace=0",
        "postgresql://u@h/db?mode=lease&sslmode=disable&application_name=x&myapp.tenant=3",
    ],
)
def test_good_urls_are_accepted(url: str) -> None:
    assert isinstance(asynclock.connect(url), asynclock.Backend)


def test_url_timeouts_are_the_drivers_own() -> None:
    """A Redis URL's timeouts are used (before the fix, the driver kept its 1 s default
    while the connection pool took the URL's value, even a negative one)."""
    node = asynclock.connect("redis://h/0?socket_timeout=2.5&connect_timeout=0.5").driver.node  # type: ignore[attr-defined]
    assert (node.socket_timeout, node.connect_timeout) == (2.5, 0.5)
    node = asynclock.connect("redis://h/0?socket_connect_timeout=0.25").driver.node  # type: ignore[attr-defined]
    assert node.connect_timeout == 0.25


def test_good_keyword_options_are_accepted() -> None:
    redis_options: dict[str, Any] = {"max_connections": 3, "retry_on_timeout": True, "fair": 0}
    assert asynclock.connect("redis://h", socket_timeout=2, **redis_options)
    assert asynclock.connect("rediss://h", ssl_ca_certs="/ca.pem", client_name="me")
    assert asynclock.connect("unix:///tmp/r.sock", db=2)
    assert asynclock.connect("redlock://a,b,c", node_timeout=1.0, password="pw")
    assert asynclock.connect("sqlite:///x.db", synchronous="full", busy_timeout=2)
    assert asynclock.connect("postgresql://u@h/db", mode="lease", poll=0.5, check_pooler=False)
