"""Semaphores and read-write locks on ZooKeeper (issue 42): what the conformance suite
cannot see — the nodes apart from locks, a session expired at the server, the limit race,
the nodes as kazoo shows them, renewal of many permits in one call, and that kazoo's own
recipes are another protocol."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

import asynclock
import asynclock.testing
from asynclock._core.permit_store import Full, Granted, OtherLimit
from asynclock._core.rw_store import WRITE
from asynclock.backends.zookeeper._paths import reserved_path
from tests.backends.test_zookeeper import expire, in_thread, kazoo, zk_driver
from tests.support.zk_servers import ZkEnsemble
from tests.test_cli_ops import cli

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
async def zk(zk_ensemble: ZkEnsemble) -> AsyncIterator[asynclock.Backend]:
    async with asynclock.connect(zk_ensemble.url) as backend:
        yield backend


async def test_permits_and_holds_are_not_locks(zk: asynclock.Backend, lock_name: str) -> None:
    """Their nodes are in asynclock's reserved area: a lock of the same name, or of a
    name that would prefix them, never sees them as holders, and the lock listing skips
    them (it does not walk the area)."""
    with anyio.fail_after(10):
        async with (
            zk.semaphore(lock_name, 2).acquire(ttl=5),
            zk.rwlock(lock_name).read(ttl=5),
            zk.lock(lock_name, ttl=5),
        ):
            names = [h.name for h in await zk.holders()]
            assert lock_name in names
            assert not [n for n in names if "asynclock." in n], names
            for other in (lock_name + "/p", lock_name + "/p/0", "\x00asynclock.sem"):
                assert await zk.holder(other) is None
            assert not [n for n in await zk.driver.names() if "asynclock." in n]


async def test_a_session_expired_at_the_server_loses_its_permits(
    zk_ensemble: ZkEnsemble, lock_name: str
) -> None:
    url = zk_ensemble.url + "?session_timeout=3"
    async with asynclock.connect(url) as backend, asynclock.connect(url) as other:
        sem = backend.semaphore(lock_name, 2)
        with pytest.raises(asynclock.LeaseLost) as info:
            async with sem.acquire(ttl=30.0) as a, sem.acquire(ttl=30.0):
                client_id = zk_driver(backend).zk.client.client_id
                await in_thread(expire, zk_ensemble.hosts, client_id)
                with anyio.fail_after(15):
                    await anyio.sleep_forever()
        assert "session expired" in info.value.reason
        assert not zk_driver(backend).nodes.entries  # every permit went with it
        # Both slots are free at once (the session's nodes are gone), with larger tokens.
        theirs = other.semaphore(lock_name, 2)
        with anyio.fail_after(10):
            async with theirs.acquire(ttl=5, blocking=False) as x, theirs.acquire(ttl=5) as y:
                assert {x.slot, y.slot} == {0, 1}
                assert min(x.token, y.token) > a.token
        # The backend goes on with a new session.
        with anyio.fail_after(10):
            async with sem.acquire(ttl=5, blocking=False) as again:
                assert again.token > a.token


async def test_another_limit_never_creates_a_permit(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str
) -> None:
    """A limit-3 grant while a limit-2 permit is live answers OtherLimit: it never
    creates a permit node, even on a slot that is free; once no permit is live, the new
    limit replaces the old one in the same multi as its first permit."""
    two = zk.semaphore(lock_name, 2)._store
    three = zk.semaphore(lock_name, 3)._store
    first = await two.grant("owner-a", 5)
    second = await two.grant("owner-b", 5)
    assert isinstance(first, Granted) and isinstance(second, Granted)
    assert await two.release_permit("owner-a", first.slot, first.token)
    assert await three.grant("owner-c", 5) == OtherLimit(2)
    base = reserved_path("", "sem", lock_name)
    async with kazoo(zk_ensemble.hosts) as raw:
        assert await in_thread(raw.get_children, base + "/p") == [str(second.slot)]
        assert await two.release_permit("owner-b", second.slot, second.token)
        third = await three.grant("owner-c", 5)
        assert isinstance(third, Granted) and third.token > second.token
        data, _ = await in_thread(raw.get, base + "/limit")
        assert data == b"3"
        assert await two.grant("owner-d", 5) == OtherLimit(3)
        assert await in_thread(raw.get_children, base + "/p") == [str(third.slot)]
    assert await three.release_permit("owner-c", third.slot, third.token)


async def test_permit_nodes_as_kazoo_shows_them(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str
) -> None:
    """One ephemeral node per live permit, of our session, its token from its czxid; tokens
    rise per slot; released: gone."""
    sem = zk.semaphore(lock_name, 2)
    base = reserved_path("", "sem", lock_name) + "/p"
    session = zk_driver(zk).zk.session_id
    eras = zk_driver(zk).eras
    seen: dict[int, list[int]] = {0: [], 1: []}
    async with kazoo(zk_ensemble.hosts) as raw:
        with anyio.fail_after(20):
            for _ in range(3):
                async with sem.acquire(ttl=5) as a, sem.acquire(ttl=5) as b:
                    for p in (a, b):
                        seen[p.slot].append(p.token)
                        data, stat = await in_thread(raw.get, f"{base}/{p.slot}")
                        assert p.token == eras.token(stat.czxid)
                        assert stat.ephemeralOwner == session
                        assert p.lease.owner.encode() in data
            assert await in_thread(raw.get_children, base) == []
    for tokens in seen.values():
        assert len(tokens) == 3 and tokens == sorted(set(tokens))


async def test_a_writer_epoch_is_its_nodes_czxid(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str
) -> None:
    rw = zk.rwlock(lock_name)
    base = reserved_path("", "rw", lock_name)
    era = zk_driver(zk).eras.era
    assert era is not None
    async with kazoo(zk_ensemble.hosts) as raw:
        with anyio.fail_after(10):
            async with rw.read(ttl=5) as before:
                assert before.token == era.base  # no write yet: the era's first token
            async with rw.write(ttl=5) as w:
                _, stat = await in_thread(raw.get, base + "/w")
                assert era.token(stat.czxid) == w.token and stat.ephemeralOwner
            _, epoch = await in_thread(raw.get, base + "/e")
            assert era.token(epoch.mzxid) == w.token
            async with rw.read(ttl=5) as r:
                assert r.token == w.token
                assert await in_thread(raw.get_children, base + "/r")
            assert await in_thread(raw.exists, base + "/w") is None


async def test_kazoos_recipes_are_another_protocol(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str
) -> None:
    """As documented: kazoo's WriteLock and Semaphore on the same path neither see nor
    exclude asynclock's rwlock and semaphore (their nodes are elsewhere)."""
    async with kazoo(zk_ensemble.hosts) as raw:
        write = raw.WriteLock("/" + lock_name, "kazoo")
        semaphore = raw.Semaphore("/" + lock_name + "-sem", "kazoo", max_leases=1)
        assert await in_thread(write.acquire, False)
        assert await in_thread(semaphore.acquire, False)
        try:
            with anyio.fail_after(10):
                async with zk.rwlock(lock_name).write(ttl=5, blocking=False):
                    pass
                async with zk.semaphore(lock_name + "-sem", 1).acquire(ttl=5, blocking=False):
                    pass
        finally:
            await in_thread(write.release)
            await in_thread(semaphore.release)


async def test_many_permits_renew_in_one_call(zk: asynclock.Backend, lock_name: str) -> None:
    """300 permits of one semaphore held here: each renewal round is one extend call
    (one sync) for them all, and none is lost. (Was 1,000: 24 s of the suite, the time
    taken by acquiring them; a round's cost does not depend on how many.)"""
    n = 300
    sem = zk.semaphore(lock_name, n)
    nodes = zk_driver(zk).nodes
    calls = 0
    renew = nodes.renew

    async def counting(refs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await renew(refs)

    nodes.renew = counting  # type: ignore[method-assign]
    held = 0
    all_held, done = anyio.Event(), anyio.Event()

    async def hold() -> None:
        nonlocal held
        async with sem.acquire(ttl=5.0, timeout=60) as permit:
            held += 1
            if held == n:
                all_held.set()
            await done.wait()
            assert not permit.lost

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(hold)
            await all_held.wait()
            calls = 0
            for _ in range(3):
                await asynclock.testing.next_renewal_round(zk)
            rounds_calls = calls
            done.set()
    print(f"\nzookeeper: {n} permits held, {rounds_calls} extend calls over 3 renewal rounds")
    assert rounds_calls <= 3 * 2  # one per round (a round may straddle the count)


async def test_an_operator_sees_permits_and_holds(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str
) -> None:
    """sem.holders() and rw.holders() on ZooKeeper (issue 42), and what ``asynclock
    holder`` and ``list`` show of them: tokens the nodes' czxids, no expiry at the server
    (a node lives as long as its holder's session)."""
    url = zk_ensemble.url
    sem, rw = zk.semaphore(lock_name, 3), zk.rwlock(lock_name)
    with anyio.fail_after(60):
        async with sem.acquire(ttl=30) as a, sem.acquire(ttl=30) as b, rw.read(ttl=30) as r:
            found = await sem.holders()
            assert [(h.kind, h.slot, h.token, h.limit, h.remaining) for h in found] == sorted(
                ("permit", p.slot, p.token, 3, None) for p in (a, b)
            )
            assert {h.owner for h in found} == {a.lease.owner, b.lease.owner}
            assert {h.label for h in found} == {zk.owner_label}
            [read] = await rw.holders()
            assert (read.kind, read.owner, read.token) == ("read", r.lease.owner, r.token)

            code, out, err = await cli("holder", lock_name, "--url", url, "--json")
            assert code == 0, err
            seen = json.loads(out)
            assert seen["holds_note"] is None and seen["held"] is True, seen
            holds = [(h["kind"], h["slot"], h["token"], h["ttl_left"]) for h in seen["holds"]]
            assert holds == [
                *sorted(("permit", p.slot, p.token, None) for p in (a, b)),
                ("read", None, r.token, None),
            ]
            code, out, err = await cli("holder", lock_name, "--url", url)
            said = " ".join(out.split())
            assert code == 0 and "semaphore: 2 permit(s) held of limit 3" in said, (said, err)
            assert "no expiry at the server" in said and "reader: owner" in said, said

            code, out, err = await cli("list", f"*{lock_name[-8:]}", "--url", url, "--json")
            assert code == 0, err
            listed = [(h["name"], h["kind"], h["slot"], h["token"]) for h in json.loads(out)]
            assert listed == [
                *sorted((lock_name, "permit", p.slot, p.token) for p in (a, b)),
                (lock_name, "read", None, r.token),
            ]
        assert await sem.holders() == [] and await rw.holders() == []


def between_read_and_delete(
    monkeypatch: pytest.MonkeyPatch, backend: asynclock.Backend, path: str, meanwhile: Any
) -> list[bool]:
    """Run ``meanwhile()`` once, after the release's read of ``path`` has answered and
    before its delete goes out (the window of a two-step delete)."""
    zk, ran = zk_driver(backend).zk, list[bool]()

    def wrap(real: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def read(*args: Any) -> Any:
            answer = await real(*args)
            if not ran and path in ([args[0]] if isinstance(args[0], str) else args[0]):
                ran.append(True)
                await meanwhile()
            return answer

        return read

    monkeypatch.setattr(zk, "get", wrap(zk.get))
    monkeypatch.setattr(zk, "read_many", wrap(zk.read_many))
    return ran


async def test_a_release_never_deletes_a_successors_node_of_the_same_path(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator deletes a permit's (a writer's) node and another holder is granted the
    same slot (the writer's node) at once, between the release's read and its delete: the
    new node has the same path and data version, and the release must leave it alone."""
    slot_path = reserved_path("", "sem", lock_name) + "/p/0"
    writer_path = reserved_path("", "rw", lock_name) + "/w"
    async with asynclock.connect(zk_ensemble.url) as other, kazoo(zk_ensemble.hosts) as raw:
        with anyio.fail_after(30):
            mine, theirs = zk.semaphore(lock_name, 1)._store, other.semaphore(lock_name, 1)._store
            granted = await mine.grant("owner-a", 30.0)
            assert isinstance(granted, Granted) and granted.slot == 0
            successor: list[Any] = []

            async def operator_and_successor() -> None:
                await in_thread(raw.delete, slot_path)
                successor.append(await theirs.grant("owner-b", 30.0))

            ran = between_read_and_delete(monkeypatch, zk, slot_path, operator_and_successor)
            assert not await mine.release_permit("owner-a", 0, granted.token)
            assert ran and isinstance(successor[0], Granted)
            _, stat = await in_thread(raw.get, slot_path)  # the successor's node is there
            era = zk_driver(other).eras  # tokens are on the wipe marker's base
            assert era.token(stat.czxid) == successor[0].token
            monkeypatch.undo()

            rw, their_rw = zk.rwlock(lock_name)._store, other.rwlock(lock_name)._store
            token = await rw.grant(WRITE, "owner-a", 30.0, intend=False)
            assert isinstance(token, int)
            writers: list[Any] = []

            async def operator_and_writer() -> None:
                await in_thread(raw.delete, writer_path)
                writers.append(await their_rw.grant(WRITE, "owner-b", 30.0, intend=False))

            ran = between_read_and_delete(monkeypatch, zk, writer_path, operator_and_writer)
            assert not await rw.release_hold(WRITE, "owner-a", token)
            assert ran and isinstance(writers[0], int) and writers[0] > token
            _, stat = await in_thread(raw.get, writer_path)
            assert era.token(stat.czxid) == writers[0]
            assert await theirs.release_permit("owner-b", 0, successor[0].token)
            assert await their_rw.release_hold(WRITE, "owner-b", writers[0])


async def test_a_waiters_place_is_a_sequential_node_of_its_session(
    zk_ensemble: ZkEnsemble, zk: asynclock.Backend, lock_name: str, monkeypatch: Any
) -> None:
    """A queued waiter's place is an ephemeral sequential node under ``q`` (its owner in
    its data), in arrival order, and not a permit (``holders()`` lists the holder only).
    An ask while every permit is held is one round trip (its place's set, the count of
    permits, the place just ahead); a withdrawn place is gone at once, and a granted
    waiter's place goes in its grant's multi."""
    store = zk.semaphore(lock_name, 1)._store
    held = await store.grant("the-holder", 5)
    assert isinstance(held, Granted)
    for waiter in ("waiter-a", "waiter-b"):
        assert isinstance(await store.grant(waiter, 5, queue=True), Full)
    queue = reserved_path("", "sem", lock_name) + "/q"
    driver = zk_driver(zk)
    async with kazoo(zk_ensemble.hosts) as raw:
        names = sorted(await in_thread(raw.get_children, queue), key=lambda n: n[-10:])
        assert [n[:-10] for n in names] == ["waiter-a-", "waiter-b-"]
        data, stat = await in_thread(raw.get, f"{queue}/{names[0]}")
        assert stat.ephemeralOwner == driver.zk.session_id and b"waiter-a" in data

        calls: list[str] = []
        real = driver._call

        async def counted(what: str, call: Callable[[], Awaitable[Any]]) -> Any:
            calls.append(what)
            return await real(what, call)

        monkeypatch.setattr(driver, "_call", counted)
        assert isinstance(await store.grant("waiter-b", 5, queue=True), Full)
        assert len(calls) == 1, calls
        assert [h.owner for h in await zk.semaphore(lock_name, 1).holders()] == ["the-holder"]

        await store.withdraw("waiter-a")
        assert await in_thread(raw.get_children, queue) == [names[1]]
        assert await store.release_permit("the-holder", held.slot, held.token)
        granted = await store.grant("waiter-b", 5, queue=True)
        assert isinstance(granted, Granted)
        assert await in_thread(raw.get_children, queue) == []
    assert await store.release_permit("waiter-b", granted.slot, granted.token)


async def test_a_waiter_that_arrived_since_the_listing_is_not_overtaken(
    zk_ensemble: ZkEnsemble, lock_name: str
) -> None:
    """A process whose last listing saw no waiter grants without listing again, but its
    multi checks the queue's data version (every place is created with a set of ``q``): a
    waiter that arrived in another process since is not overtaken."""
    async with asynclock.connect(zk_ensemble.url) as x, asynclock.connect(zk_ensemble.url) as y:
        xs, ys = x.semaphore(lock_name, 1)._store, y.semaphore(lock_name, 1)._store
        first = await xs.grant("x-first", 5)
        assert isinstance(first, Granted)
        assert await xs.release_permit("x-first", first.slot, first.token)
        held = await ys.grant("y-holder", 5)
        assert isinstance(held, Granted)
        assert isinstance(await ys.grant("y-waiter", 5, queue=True), Full)
        assert await ys.release_permit("y-holder", held.slot, held.token)
        assert zk_driver(x).nodes.queues[lock_name][1] == ()  # x saw no waiter
        assert isinstance(await xs.grant("x-late", 5), Full)
        granted = await ys.grant("y-waiter", 5, queue=True)
        assert isinstance(granted, Granted)
        assert await ys.release_permit("y-waiter", granted.slot, granted.token)


async def test_a_queued_waiter_sees_another_limit(zk_ensemble: ZkEnsemble, lock_name: str) -> None:
    """A waiter whose cached limit went stale while it waited (every permit released, then
    one taken under another limit) is told OtherLimit, not kept waiting for ever."""
    async with asynclock.connect(zk_ensemble.url) as x, asynclock.connect(zk_ensemble.url) as y:
        xs = x.semaphore(lock_name, 1)._store
        held = await xs.grant("x-holder", 5)
        assert isinstance(held, Granted)
        assert isinstance(await xs.grant("x-waiter", 5, queue=True), Full)
        assert await xs.release_permit("x-holder", held.slot, held.token)
        other = await y.semaphore(lock_name, 2)._store.grant("y-holder", 5)
        assert isinstance(other, Granted)
        assert await xs.grant("x-waiter", 5, queue=True) == OtherLimit(2)
        await xs.withdraw("x-waiter")
