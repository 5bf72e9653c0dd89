"""Bad input fails fast with a message that says what was wrong and what is allowed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

import asynclock

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("", ValueError, "non-empty"),
        ("x" * 513, ValueError, "at most 512"),
        ("é" * 257, ValueError, "514 UTF-8 bytes"),
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
    ],
)
async def test_bad_lock_arguments(
    backend: asynclock.Backend, kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        backend.lock("x", **kwargs)


async def test_ttl_too_short_for_margin(backend: asynclock.Backend) -> None:
    with pytest.raises(ValueError, match="leaves no time"):
        await backend.acquire("x", ttl=0.001)


@pytest.mark.parametrize(
    ("token", "error"), [(0, ValueError), (-3, ValueError), (2**63, ValueError), ("1", TypeError)]
)
async def test_bad_tokens(backend: asynclock.Backend, token: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="fencing token"):
        await backend.validate("x", token)


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
