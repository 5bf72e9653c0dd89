"""G2: tokens strictly increase across release, expiry and a kill -9 of the holder."""

from __future__ import annotations

import signal

import pytest

import asynclock
import asynclock.testing
from tests.support.procs import start_worker
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


async def test_tokens_increase_across_release(backend: asynclock.Backend, lock_name: str) -> None:
    tokens = []
    for _ in range(5):
        async with backend.lock(lock_name, ttl=5.0) as lease:
            tokens.append(lease.token)
            assert lease.token > 0
    assert tokens == sorted(set(tokens))


async def test_tokens_increase_across_expiry(backend: asynclock.Backend, lock_name: str) -> None:
    first = await backend.acquire(lock_name, ttl=0.2)
    # Let it expire on the server: stop renewing by losing it locally, without releasing.
    asynclock.testing.force_loss(first, "test: abandon without release")
    second = await backend.acquire(lock_name, ttl=5.0, timeout=10)
    assert second.token > first.token
    assert await first.release() is False
    assert await second.release() is True


async def test_tokens_increase_after_holder_is_killed(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    worker = await start_worker(shared_spec, mode="hold", name=lock_name, ttl=0.5)
    acquired = await worker.expect("acquired")
    worker.signal(signal.SIGKILL)
    await worker.wait()
    async with shared_spec.connect() as backend:
        # Blocks until the dead holder's lease expires on the server (its ttl).
        async with backend.lock(lock_name, ttl=5.0, timeout=10) as lease:
            assert lease.token > acquired["token"]


async def test_validate_tracks_the_live_holder(backend: asynclock.Backend, lock_name: str) -> None:
    async with backend.lock(lock_name, ttl=5.0) as lease:
        assert await backend.validate(lock_name, lease.token)
        assert not await backend.validate(lock_name, lease.token + 1)
        if lease.token > 1:
            assert not await backend.validate(lock_name, lease.token - 1)
    assert not await backend.validate(lock_name, lease.token)
