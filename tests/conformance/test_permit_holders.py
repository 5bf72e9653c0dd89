"""Who holds a semaphore's permits and a read-write lock (issue 42: ``asynclock holder`` and
``list`` show every permit's holder): ``sem.holders()`` and ``rw.holders()`` on every
backend with the ``holds`` capability; NotImplementedError, saying so, elsewhere."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import asynclock
from tests.support.spec import BackendSpec, specs_split_by

pytestmark = pytest.mark.anyio

spec, other_spec = specs_split_by("holds")


async def other_backend(spec: BackendSpec, backend: asynclock.Backend) -> tuple[Any, Any]:
    """A second backend on the same server, another owner label (memory: the same one)."""
    if spec.id == "memory":
        return None, backend
    cm = spec.connect(owner_label="second-worker")
    return cm, await cm.__aenter__()


async def test_every_live_permit_is_listed_by_slot(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    sem = backend.semaphore(lock_name, 3)
    cm, other = await other_backend(spec, backend)
    try:
        with anyio.fail_after(15):
            assert await sem.holders() == []
            async with (
                sem.acquire(ttl=10) as first,
                other.semaphore(lock_name, 3).acquire(ttl=10) as second,
            ):
                found = await sem.holders()
                # Another limit's semaphore object lists them too (its limit is not checked).
                assert [h.token for h in await backend.semaphore(lock_name, 7).holders()] == [
                    h.token for h in found
                ]
                # A lock of the same name is another namespace.
                assert await backend.holder(lock_name) is None
            after = await sem.holders()
    finally:
        if cm is not None:
            await cm.__aexit__(None, None, None)
    assert after == []
    assert [h.slot for h in found] == sorted([first.slot, second.slot])
    by_slot = {h.slot: h for h in found}
    for permit in (first, second):
        h = by_slot[permit.slot]
        assert (h.kind, h.name, h.limit) == ("permit", lock_name, 3)
        assert h.owner == permit.lease.owner and h.token == permit.token
        if spec.can("session_holds"):  # no expiry at the server: the session keeps it
            assert h.remaining is None
        else:
            assert h.remaining is not None and 0 < h.remaining <= 10
    if cm is not None:
        assert by_slot[second.slot].label == "second-worker"
        assert by_slot[first.slot].label == backend.owner_label


async def test_a_released_permit_leaves_the_list(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    sem = backend.semaphore(lock_name, 2)
    with anyio.fail_after(10):
        async with sem.acquire(ttl=10) as a, sem.acquire(ttl=10) as b:
            assert len(await sem.holders()) == 2
            await a.release()
            assert [(h.slot, h.token) for h in await sem.holders()] == [(b.slot, b.token)]


async def test_the_writer_readers_and_waiting_writers(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    rw = backend.rwlock(lock_name)
    cm, other = await other_backend(spec, backend)
    got_write, done = anyio.Event(), anyio.Event()
    seen: dict[str, Any] = {}
    try:
        with anyio.fail_after(20):
            assert await rw.holders() == []
            async with anyio.create_task_group() as tg:
                async with (
                    rw.read(ttl=10) as r1,
                    other.rwlock(lock_name).read(ttl=10) as r2,
                ):

                    async def writer() -> None:
                        async with rw.write(ttl=10, timeout=15) as w:
                            seen["w"] = w
                            got_write.set()
                            await done.wait()

                    tg.start_soon(writer)
                    # The server is the only place the writer's intent shows (no event to
                    # wait on): ask it until it does, bounded by fail_after.
                    while not any(h.kind == "intent" for h in await rw.holders()):  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    seen["waiting"] = await rw.holders()
                await got_write.wait()
                seen["writing"] = await rw.holders()
                done.set()
            seen["after"] = await rw.holders()
    finally:
        if cm is not None:
            await cm.__aexit__(None, None, None)
    waiting = seen["waiting"]
    assert [h.kind for h in waiting] == ["read", "read", "intent"]
    reads = {h.owner: h for h in waiting if h.kind == "read"}
    assert set(reads) == {r1.lease.owner, r2.lease.owner}
    assert {h.token for h in reads.values()} == {r1.token} == {r2.token}
    if spec.can("session_holds"):
        assert all(h.remaining is None for h in waiting)
    else:
        assert all(h.remaining is not None and 0 < h.remaining <= 10 for h in waiting)
    intent = waiting[2]
    assert intent.token is None and intent.name == lock_name
    w = seen["w"]
    assert intent.owner == w.lease.owner
    [writing] = seen["writing"]
    assert (writing.kind, writing.owner, writing.token) == ("write", w.lease.owner, w.token)
    assert seen["after"] == []


async def test_holders_lists_permits_and_holds_beside_locks(
    spec: BackendSpec, backend: asynclock.Backend, lock_name: str
) -> None:
    """``backend.holders(kinds=...)`` (``asynclock list``): every live permit and
    read-write hold of the names matching, as sem.holders()/rw.holders() see them, beside
    the locks (a name's lock first); locks only by default."""
    holds = ("permit", "write", "read", "intent")
    pattern, rw_name = f"*{lock_name[-8:]}*", lock_name + ":rw"
    with pytest.raises(ValueError, match="kinds may be any of"):
        await backend.holders(pattern, kinds=("permits",))
    with anyio.fail_after(15):
        async with (
            backend.semaphore(lock_name, 2).acquire(ttl=10) as p,
            backend.rwlock(rw_name).write(ttl=10) as w,
        ):
            found = await backend.holders(pattern, kinds=holds)
            assert [(h.name, h.kind, h.slot, h.limit, h.token) for h in found] == [
                (lock_name, "permit", p.slot, 2, p.token),
                (rw_name, "write", None, None, w.token),
            ]
            assert found[0].owner == p.lease.owner and found[1].owner == w.lease.owner
            assert [h.kind for h in await backend.holders(pattern, kinds="write")] == ["write"]
            one = await backend.holders(pattern, kinds=holds, limit=1)
            assert [(h.name, h.kind, h.token) for h in one] == [(lock_name, "permit", p.token)]
            if spec.can("names"):
                assert await backend.holders(pattern) == []  # locks only, by default
                async with backend.lock(lock_name, ttl=10) as lease:
                    every = await backend.holders(pattern, kinds=("lock", *holds))
                assert [(h.name, h.kind, h.token) for h in every] == [
                    (lock_name, "lock", lease.token),
                    (lock_name, "permit", p.token),
                    (rw_name, "write", w.token),
                ]
        assert await backend.holders(pattern, kinds=holds) == []


async def test_not_on_this_backend(other_spec: BackendSpec, lock_name: str) -> None:
    async with other_spec.connect() as backend:
        for make in (lambda: backend.semaphore(lock_name, 2), lambda: backend.rwlock(lock_name)):
            try:
                made = make()
            except NotImplementedError:
                continue  # no semaphores / rwlocks here at all
            with pytest.raises(NotImplementedError, match="does not list"):
                await made.holders()
