"""G2 per token scope: leases on different names drawn from one scope get rising tokens."""

from __future__ import annotations

import signal

import pytest

import asynclock
import asynclock.testing
from tests.support.procs import start_worker
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


async def test_scope_tokens_increase_across_names(
    backend: asynclock.Backend, lock_name: str
) -> None:
    scope = f"job:{lock_name}"
    tokens = []
    for i in range(6):
        async with backend.lock(f"{lock_name}@{i}", ttl=5.0, token_scope=scope) as lease:
            tokens.append(lease.token)
        # A plain lock of another name in between must not break the scope's order.
        async with backend.lock(f"{lock_name}:other{i}", ttl=5.0):
            pass
    assert tokens == sorted(set(tokens)), tokens


async def test_scope_tokens_increase_when_a_name_counter_is_ahead(
    backend: asynclock.Backend, lock_name: str
) -> None:
    scope = f"job:{lock_name}"
    # A name whose own counter ran ahead (SQLite starts every new name at 1; Redis
    # seeds each new counter from TIME): the scope still goes up, and so does the name.
    for _ in range(3):
        async with backend.lock(f"{lock_name}@busy", ttl=5.0):
            pass
    async with backend.lock(f"{lock_name}@busy", ttl=5.0) as plain:
        pass
    async with backend.lock(f"{lock_name}@busy", ttl=5.0, token_scope=scope) as a:
        assert a.token > plain.token
    async with backend.lock(f"{lock_name}@fresh", ttl=5.0, token_scope=scope) as b:
        assert b.token > a.token
    async with backend.lock(f"{lock_name}@busy", ttl=5.0) as again:
        assert again.token > a.token
    c = await backend.acquire(f"{lock_name}@third", ttl=5.0, token_scope=scope, blocking=False)
    try:
        assert c.token > b.token
    finally:
        await c.release()


async def test_scope_tokens_increase_across_expiry_and_busy_attempts(
    backend: asynclock.Backend, lock_name: str
) -> None:
    scope = f"job:{lock_name}"
    first = await backend.acquire(f"{lock_name}@1", ttl=0.2, token_scope=scope)
    with pytest.raises(asynclock.LockHeld):
        await backend.acquire(f"{lock_name}@1", ttl=5.0, token_scope=scope, blocking=False)
    asynclock.testing.force_loss(first, "test: abandon without release")
    # The same name after its expiry (a blocking waiter), then a new name.
    second = await backend.acquire(f"{lock_name}@1", ttl=5.0, timeout=10, token_scope=scope)
    third = await backend.acquire(f"{lock_name}@2", ttl=5.0, token_scope=scope)
    assert first.token < second.token < third.token
    assert await backend.validate(f"{lock_name}@2", third.token)
    for lease in (first, second, third):
        await lease.release()


async def test_scope_tokens_increase_after_holder_is_killed(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    scope = f"job:{lock_name}"
    worker = await start_worker(
        shared_spec, mode="hold", name=f"{lock_name}@1", ttl=0.5, token_scope=scope
    )
    acquired = await worker.expect("acquired")
    worker.signal(signal.SIGKILL)
    await worker.wait()
    async with shared_spec.connect() as backend:
        # A new name of the scope, from a new process: its token is above the dead one's.
        async with backend.lock(f"{lock_name}@2", ttl=5.0, token_scope=scope) as lease:
            assert lease.token > acquired["token"]


@pytest.mark.parametrize(
    ("scope", "error", "match"),
    [
        (42, TypeError, "token_scope must be a str or None, not int"),
        ("", ValueError, "token_scope: lock name must be a non-empty str"),
        ("x" * 513, ValueError, "token_scope: lock name is 513 UTF-8 bytes"),
    ],
)
async def test_bad_scope_is_refused_before_any_io(
    backend: asynclock.Backend, scope: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        backend.lock("n", ttl=1.0, token_scope=scope)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        await backend.acquire("n", ttl=1.0, token_scope=scope)  # type: ignore[arg-type]


async def test_let_expire_keeps_the_name_taken_for_its_ttl(
    backend: asynclock.Backend, lock_name: str
) -> None:
    lease = await backend.acquire(lock_name, ttl=1.0)
    assert await lease.let_expire() is True
    assert lease.released and not lease.lost
    assert lease not in backend.held()
    # Not released at the server: still taken until the last extension's ttl runs out.
    with pytest.raises(asynclock.LockHeld):
        await backend.acquire(lock_name, ttl=1.0, blocking=False)
    later = await backend.acquire(lock_name, ttl=1.0, timeout=10)
    assert later.token > lease.token
    assert await lease.let_expire() is False  # already given up
    await later.release()
