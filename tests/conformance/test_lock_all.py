"""``backend.lock_all(names, ttl=...)`` (issue 42 item 3) on every backend: all or nothing,
one canonical order (no deadlock between overlapping sets), any one loss cancels the body.

Synchronised on events and driver hooks, never on sleeps; every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asynclock
import asynclock.testing
from asynclock.backends import Busy
from tests.conformance.test_cancellation import Injector
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
async def other(spec: BackendSpec, backend: asynclock.Backend) -> AsyncIterator[asynclock.Backend]:
    """A second backend instance on the same server (another process, as far as the
    server can tell); the same one for a backend whose locks live in one instance (memory),
    used from other tasks."""
    if not spec.multiprocess:
        yield backend
        return
    async with spec.connect() as b:
        yield b


@asynccontextmanager
async def held_elsewhere(other: asynclock.Backend, name: str) -> AsyncIterator[None]:
    """``name`` held by another task of ``other`` for the ``async with`` body."""
    taken, done = anyio.Event(), anyio.Event()

    async def hold() -> None:
        async with other.lock(name, ttl=5.0):
            taken.set()
            await done.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        with anyio.fail_after(10):
            await taken.wait()
        try:
            yield
        finally:
            done.set()


async def busy_for_other(other: asynclock.Backend, name: str) -> bool:
    """Whether another task of ``other`` finds ``name`` busy right now."""
    busy = False

    async def attempt() -> None:
        nonlocal busy
        try:
            async with other.lock(name, ttl=5.0, blocking=False):
                pass
        except asynclock.LockHeld:
            busy = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(attempt)
    return busy


def names_of(base: str, *suffixes: str) -> list[str]:
    return [f"{base}:{suffix}" for suffix in suffixes]


async def assert_all_free(backend: asynclock.Backend, names: list[str]) -> None:
    """Every one of ``names`` can be taken right now (nothing left held), then is let go."""
    for name in names:
        async with backend.lock(name, ttl=5.0, blocking=False) as lease:
            assert await backend.validate(name, lease.token)


def busy_event(backend: asynclock.Backend, name: str) -> anyio.Event:
    """An event set when ``backend``'s driver answers busy for ``name``."""
    seen = anyio.Event()

    async def hook(call: Any, *args: Any, **kwargs: Any) -> Any:
        result = await call(*args, **kwargs)
        if isinstance(result, Busy) and args and args[0] == name:
            seen.set()
        return result

    asynclock.testing.DriverFaults(backend).around("acquire", hook)
    return seen


async def test_every_name_is_held_with_its_token(
    backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    names = names_of(lock_name, "c", "a", "b")
    with anyio.fail_after(20):
        async with backend.lock_all(names, ttl=5.0) as held:
            assert list(held) == sorted(names) and len(held) == 3
            assert [lease.name for lease in held.leases] == sorted(names)
            assert held.tokens == {name: held[name].token for name in names}
            assert asynclock.current_lease() is held.leases[-1]
            held.check()
            for name in names:
                assert await backend.validate(name, held[name].token)
                assert await busy_for_other(other, name)
                # Not re-entrant, as lock(): this task holds the name already.
                with pytest.raises(asynclock.AlreadyHeld, match="lock_all"):
                    async with backend.lock(name, ttl=5.0):
                        pass  # pragma: no cover
        assert backend.held() == []
        await assert_all_free(other, names)


async def test_opposite_orders_never_deadlock(
    backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    """Four callers on two backend instances take overlapping sets given in opposite
    orders, several rounds each: every one completes, and no name is ever held twice."""
    x, y, z = names_of(lock_name, "x", "y", "z")
    inside: dict[str, int] = {x: 0, y: 0, z: 0}
    most = 0

    async def caller(on: asynclock.Backend, names: list[str]) -> None:
        nonlocal most
        for _ in range(3):
            async with on.lock_all(names, ttl=5.0) as held:
                for name in held:
                    inside[name] += 1
                most = max(most, *inside.values())
                await anyio.lowlevel.checkpoint()  # let the others queue behind us
                await anyio.lowlevel.checkpoint()
                for name in held:
                    inside[name] -= 1

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, backend, [x, y, z])
            tg.start_soon(caller, backend, [z, y, x])
            tg.start_soon(caller, other, [z, x])
            tg.start_soon(caller, other, [y, x])
    assert most == 1
    assert backend.held() == [] and other.held() == []


async def test_a_busy_name_midway_leaves_none_held(
    backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    first, middle, last = names = names_of(lock_name, "a", "m", "z")
    with anyio.fail_after(15):
        async with held_elsewhere(other, middle):
            with pytest.raises(asynclock.LockHeld) as busy:
                async with backend.lock_all(names, ttl=5.0, blocking=False):
                    pass  # pragma: no cover
            assert busy.value.name == middle
            assert not any(lease.name in (first, last) for lease in backend.held())
            await assert_all_free(other, [first, last])
            # The timeout bounds the whole acquisition, and also leaves nothing held.
            started = time.monotonic()
            with pytest.raises(asynclock.AcquireTimeout) as timed_out:
                async with backend.lock_all(names, ttl=5.0, timeout=0.3):
                    pass  # pragma: no cover
            assert timed_out.value.name == middle and timed_out.value.timeout == 0.3
            assert "lock_all()" in str(timed_out.value)
            assert time.monotonic() - started < 0.3 + 2.0
            assert not any(lease.name in (first, last) for lease in backend.held())
            await assert_all_free(other, [first, last])
        await assert_all_free(other, names)


async def test_the_loss_of_any_one_cancels_the_body_and_releases_the_rest(
    backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    names = names_of(lock_name, "a", "b", "c")
    cancelled = False
    with anyio.fail_after(20):
        with pytest.raises(asynclock.LeaseLost) as info:
            async with backend.lock_all(names, ttl=5.0) as held:
                try:
                    asynclock.testing.force_loss(held[names[1]], "test: one of three")
                    await anyio.sleep_forever()
                finally:
                    cancelled = True
        assert cancelled
        assert info.value.name == names[1] and info.value.reason == "test: one of three"
        assert backend.held() == []
        await assert_all_free(other, names)


async def test_a_lease_ended_at_the_server_cancels_the_body(
    spec: BackendSpec, backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    """The spec's sabotage deletes one lease behind the holder's back: its next renewal is
    refused, the body is cancelled and the block names it; the others are released."""
    names = names_of(lock_name, "a", "b", "c")
    with anyio.fail_after(20):
        with pytest.raises(asynclock.LeaseLost) as info:
            async with backend.lock_all(names, ttl=0.9):
                await spec.sabotage(backend, names[2])
                await anyio.sleep_forever()
        assert info.value.name == names[2]
        assert backend.held() == []
        await assert_all_free(other, names)


async def test_a_loss_while_waiting_for_the_rest_gives_up_at_once(
    backend: asynclock.Backend, other: asynclock.Backend, lock_name: str
) -> None:
    """A lease taken already is lost while a later name is waited for: the wait ends
    (LeaseLost naming it, not a wait for the busy name) and nothing is left held."""
    first, busy = names = names_of(lock_name, "a", "b")
    waiting = busy_event(backend, busy)
    async with held_elsewhere(other, busy):
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def lose_first() -> None:
                    await waiting.wait()
                    [lease] = [lease for lease in backend.held() if lease.name == first]
                    asynclock.testing.force_loss(lease, "test: lost while waiting")

                tg.start_soon(lose_first)
                with pytest.raises(asynclock.LeaseLost) as info:
                    async with backend.lock_all(names, ttl=5.0):
                        pass  # pragma: no cover
            assert info.value.name == first
            assert [lease.name for lease in backend.held()] in ([], [busy])
    await assert_all_free(other, names)


async def test_cancelled_at_every_await_leaves_nothing_held(
    spec: BackendSpec, lock_name: str
) -> None:
    """The acquiring task is cancelled at each driver call's before and after (the server
    did the work, the answer never came back) in turn: three names, the last one busy
    until the wait began. Every name is free at once afterwards."""
    async with spec.connect() as backend:
        injector = Injector(backend)

        async def scenario(base: str) -> None:
            names = names_of(base, "a", "b", "c")
            injector.points = []
            injector.task_id = None  # (a new task may reuse the last one's id)
            injector.fired = None
            injector.busy_seen = anyio.Event()
            a_holds = anyio.Event()

            async def holder() -> None:
                async with backend.lock(names[2], ttl=5.0):
                    a_holds.set()
                    await injector.busy_seen.wait()

            async def taker() -> None:
                await a_holds.wait()
                injector.task_id = anyio.get_current_task().id
                try:
                    with anyio.CancelScope() as scope:
                        injector.scope = scope
                        async with backend.lock_all(names, ttl=5.0, timeout=10) as held:
                            assert len(held) == 3
                finally:
                    injector.busy_seen.set()

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(holder)
                    tg.start_soon(taker)
            assert backend.held() == []
            await assert_all_free(backend, names)

        injector.cancel_at = None
        await scenario(lock_name + ":count")
        labels = list(injector.points)
        for expected in ("acquire:after", "watch:before", "release:after"):
            assert expected in labels, labels
        for k, label in enumerate(labels):
            injector.cancel_at = k
            await scenario(f"{lock_name}:{k}")
            assert injector.fired == label, (k, injector.points)


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        ("abc", TypeError, "not a single str"),
        (b"ab", TypeError, "not a single bytes"),
        (7, TypeError, "not int"),
        ([], ValueError, "at least one"),
        (["a", 1], TypeError, r"names\[1\] is int"),
        (["a", ""], ValueError, "non-empty"),
        (["b", "a", "b"], ValueError, "'b' appears more than once"),
        ([f"n{i}" for i in range(1001)], ValueError, "at most 1000"),
        (["\x00asynclock.x"], ValueError, "keeps for its own"),
    ],
)
async def test_bad_names_are_refused_at_the_call(names: Any, error: type, match: str) -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(error, match=match):
            backend.lock_all(names, ttl=5.0)
        assert backend.held() == []


async def test_bad_options_are_refused_and_good_inputs_accepted() -> None:
    async with asynclock.connect("memory://") as backend:
        with pytest.raises(ValueError, match="timeout only applies"):
            backend.lock_all(["a"], ttl=5.0, timeout=1.0, blocking=False)
        with pytest.raises(TypeError, match="ttl"):
            backend.lock_all(["a"], ttl="5")  # type: ignore[arg-type]
        # Any iterable of str but a str: a tuple, a set, a generator; exactly 1000 names.
        many = backend.lock_all((f"n{i}" for i in range(1000)), ttl=5.0)
        assert len(many.names) == 1000
        async with backend.lock_all({"b", "a"}, ttl=5.0) as held:
            assert list(held) == ["a", "b"]
        with pytest.raises(TypeError, match="async with"):
            with backend.lock_all(["a"], ttl=5.0):  # type: ignore[attr-defined]
                pass  # pragma: no cover


async def test_a_shared_lock_all_in_a_task_started_inside_its_body() -> None:
    """A child task started inside the body inherits the body's lease stack; when it enters
    the same (shared) ``lock_all`` after the parent left, it holds and ends its own hold."""
    async with asynclock.connect("memory://") as backend:
        both = backend.lock_all(["a", "b"], ttl=5.0)
        parent_done = anyio.Event()
        tokens: dict[str, int] = {}

        async def child() -> None:
            await parent_done.wait()
            async with both as held:
                tokens.update(held.tokens)
                assert asynclock.current_lease() is held["b"]
            assert backend.held() == []

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async with both as first:
                    tg.start_soon(child)
                parent_done.set()
        assert tokens == {"a": first["a"].token + 1, "b": first["b"].token + 1}
        assert backend.held() == []


async def test_max_hold_bounds_the_whole_hold() -> None:
    """``max_hold`` counts from each name's grant: the first name taken reaches it first."""
    async with asynclock.connect("memory://") as backend:
        with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost) as info:
            async with backend.lock_all(["b", "a"], ttl=5.0, max_hold=0.2):
                await anyio.sleep_forever()
        assert info.value.name == "a" and info.value.reason == "max_hold reached"
        assert backend.held() == []
