"""Leader election on every backend: one leader at a time, loss is loud, tokens fence."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

import asynclock
import asynclock.testing
from tests.support.procs import start_worker
from tests.support.spec import BackendSpec
from tests.support.worker import fenced_write

pytestmark = pytest.mark.anyio


def tells_leader(spec: BackendSpec) -> bool:
    return spec.can("leader")


async def test_three_contenders_one_leader_at_a_time(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    active: list[str] = []
    terms: list[tuple[str, int]] = []
    overlaps: list[list[str]] = []

    async def contender(identity: str) -> None:
        won = 0
        async for term in backend.leadership(lock_name, ttl=5.0, identity=identity):
            async with term:
                active.append(identity)
                if len(active) > 1:
                    overlaps.append(list(active))
                terms.append((identity, term.token))
                assert term.identity == identity
                assert asynclock.current_lease() is term.lease
                if tells_leader(spec):
                    assert await backend.leader(lock_name) == asynclock.Leader(identity, term.token)
                await anyio.sleep(0.01)  # let the others campaign while we lead
                active.remove(identity)
            won += 1
            if won == 2:
                break

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(contender, f"contender-{i}")
    assert overlaps == []
    assert len(terms) == 6
    assert sorted(identity for identity, _ in terms) == [
        f"contender-{i}" for i in range(3) for _ in range(2)
    ]
    tokens = [token for _, token in terms]
    assert tokens == sorted(tokens) and len(set(tokens)) == 6  # G2: every term larger
    assert backend.held() == []  # leaving the loop released the last term
    if tells_leader(spec):
        assert await backend.leader(lock_name) is None


async def test_leader_answers_identity_and_token(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    if not tells_leader(spec):
        with pytest.raises(NotImplementedError, match="cannot tell who"):
            await backend.leader(lock_name)
        return
    assert await backend.leader(lock_name) is None
    async with backend.leadership(lock_name, ttl=5.0, identity="node-a ✓") as term:
        assert await backend.leader(lock_name) == asynclock.Leader("node-a ✓", term.token)
    assert await backend.leader(lock_name) is None
    async with backend.leadership(lock_name, ttl=5.0) as term:  # default: host:pid
        found = await backend.leader(lock_name)
        assert found is not None and found.identity == term.identity
        assert term.identity.endswith(":" + str(__import__("os").getpid()))
    async with backend.lock(lock_name, ttl=5.0) as lease:  # a plain lock has no identity
        assert await backend.leader(lock_name) == asynclock.Leader(None, lease.token)


async def test_lost_term_cancels_the_body_and_raises(
    backend: asynclock.Backend, lock_name: str
) -> None:
    reached_end = False
    with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost) as info:
        async with backend.leadership(lock_name, ttl=5.0, identity="a") as term:
            asynclock.testing.force_loss(term.lease, "deposed in a test")
            await anyio.sleep(5)
            reached_end = True
    assert not reached_end
    assert info.value.reason == "deposed in a test"
    assert info.value.token == term.token
    assert backend.held() == []


async def test_async_for_campaigns_again_after_a_loss(
    backend: asynclock.Backend, lock_name: str
) -> None:
    tokens: list[int] = []
    cancelled = 0
    with anyio.fail_after(15):
        async for term in backend.leadership(lock_name, ttl=5.0, identity="a"):
            tokens.append(term.token)
            async with term:
                if len(tokens) < 3:
                    asynclock.testing.force_loss(term.lease)
                    try:
                        await anyio.sleep(5)
                    finally:
                        cancelled += 1
            assert term.lease.lost.reason is not None or len(tokens) == 3
            if len(tokens) == 3:
                break
    assert cancelled == 2
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert backend.held() == []


async def test_body_error_propagates_out_of_the_loop(
    backend: asynclock.Backend, lock_name: str
) -> None:
    with anyio.fail_after(10), pytest.raises(ZeroDivisionError):
        async for term in backend.leadership(lock_name, ttl=5.0):
            async with term:
                1 / 0  # noqa: B018
    assert backend.held() == []


async def test_bad_arguments_are_refused_before_io(backend: asynclock.Backend) -> None:
    with pytest.raises(ValueError, match="identity must be 1 to 200 UTF-8 bytes"):
        backend.leadership("x", ttl=1.0, identity="")
    with pytest.raises(ValueError, match="identity must be 1 to 200"):
        backend.leadership("x", ttl=1.0, identity="é" * 101)
    with pytest.raises(TypeError, match="identity must be a str or None, not int"):
        backend.leadership("x", ttl=1.0, identity=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl must be"):
        backend.leadership("x", ttl=0)
    with pytest.raises(ValueError, match="lock name must be a non-empty str"):
        backend.leadership("", ttl=1.0)
    with pytest.raises(TypeError, match="lock name must be a str"):
        await backend.leader(7)  # type: ignore[arg-type]


async def test_frozen_leader_is_deposed_and_fenced(
    shared_spec: BackendSpec, lock_name: str, tmp_path: Path
) -> None:
    """SIGSTOP a real leader process past its ttl: a successor is elected with a larger
    token, the old leader's body is cancelled on waking and its late write is stale."""
    fence_db = str(tmp_path / "resource.db")
    leader = await start_worker(
        shared_spec, mode="lead", name=lock_name, ttl=0.6, fence_db=fence_db, identity="old"
    )
    first = await leader.expect("acquired")
    leader.signal(signal.SIGSTOP)
    try:
        async with shared_spec.connect() as backend:
            if tells_leader(shared_spec):
                found = await backend.leader(lock_name)
                assert found is None or found == asynclock.Leader("old", first["token"])
            with anyio.fail_after(20):
                async with backend.leadership(lock_name, ttl=5.0, identity="new") as term:
                    assert term.token > first["token"]
                    if tells_leader(shared_spec):
                        assert await backend.leader(lock_name) == asynclock.Leader(
                            "new", term.token
                        )
                    assert fenced_write(fence_db, lock_name, term.token, "successor") == (
                        "accepted"
                    )
                    resumed_at = time.monotonic()
                    leader.signal(signal.SIGCONT)
                    lost = await leader.expect("lost")
                    late = await leader.expect("late_write")
    finally:
        leader.signal(signal.SIGCONT)
    assert lost["token"] == first["token"]
    assert lost["at"] - resumed_at < 2.0, "the old leader was not cancelled promptly"
    assert late["result"] == "stale"
    assert await leader.wait() == 0
    rows = sqlite3.connect(fence_db).execute("SELECT writer, token FROM ledger").fetchall()
    assert rows == [("holder-before-pause", first["token"]), ("successor", term.token)]
