"""asynclock.from_thread: a lease held around a synchronous body, the body stopped when
the lease is lost (a signal on the main thread, an async exception elsewhere)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

import asynclock
import asynclock.testing
from asynclock.backends.redis.keys import keys_for
from asynclock.backends.redis.replies import token_of
from asynclock.from_thread import LoopThread, guard, hold, idempotent
from tests.support.redis_servers import RedisFactory


@pytest.fixture(params=["sqlite", "redis"])
def url_spec(request: pytest.FixtureRequest) -> str:
    """sqlite: the body's thread asks the loop thread; redis (one server): it acquires and
    releases itself with the driver's blocking calls, and the loop renews and watches."""
    return str(request.param)


@pytest.fixture
def url(url_spec: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if url_spec == "redis":
        return str(request.getfixturevalue("spec_redis").url)
    return f"sqlite:///{tmp_path / 'locks.db'}"


@contextlib.contextmanager
def loop_frozen(thread: LoopThread) -> Iterator[None]:
    """The loop thread blocked (a callback that waits) for the duration of the block."""
    frozen, thaw = threading.Event(), threading.Event()

    def block() -> None:
        frozen.set()
        thaw.wait(3 * WAIT)  # longer than in_thread() waits: a body that needs the loop fails

    thread.loop.call_soon_threadsafe(block)
    assert frozen.wait(WAIT)
    try:
        yield
    finally:
        thaw.set()


def in_thread(body: Callable[[], T]) -> T:
    """``body()`` on a thread of its own, waited for at most WAIT seconds."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(body())
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(WAIT)
    assert not runner.is_alive(), "still running: it waited for the frozen loop"
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("url_spec", ["redis"], indirect=True)
def test_on_one_redis_server_the_body_thread_takes_and_gives_back_the_lock_itself(
    url: str, lock_name: str
) -> None:
    """No hand-over to the loop: with the loop thread frozen, a body still gets its lease
    and gives it back (one script round trip each, on the body's thread); the loop then
    does the bookkeeping it was told about, and the name is free at the server."""
    with LoopThread() as thread:
        backend = thread.backend(url)

        def body() -> tuple[asynclock.Lease, bool]:
            with hold(thread, url, lock_name, ttl=5.0) as lease:
                held_at_server = thread_free_check(url, lock_name) == lease.token
            return lease, held_at_server

        with loop_frozen(thread):
            lease, held_at_server = in_thread(body)
        assert held_at_server and lease.released and not lease.lost
        assert thread_free_check(url, lock_name) is None
        stats = thread.run(_settled_stats(backend))
        assert (stats.acquired, stats.released, stats.held) == (1, 1, 0)
        # A second hold on the same backend: a fresh, larger token.
        with hold(thread, url, lock_name, ttl=5.0) as again:
            assert again.token > lease.token


@pytest.mark.parametrize("url_spec", ["redis"], indirect=True)
def test_a_lease_taken_in_the_body_thread_is_renewed_by_the_loop(url: str, lock_name: str) -> None:
    with LoopThread() as thread:
        backend = thread.backend(url)
        with hold(thread, url, lock_name, ttl=1.0) as lease:
            # Held for three ttls: only renewal keeps it.
            for _ in range(6):
                thread.run(asyncio.wait_for(backend._session.next_round(), WAIT))
            assert thread_free_check(url, lock_name) == lease.token
            assert not lease.lost
        assert backend.stats().renewals >= 3
        assert lease.released and thread_free_check(url, lock_name) is None


@pytest.mark.parametrize("url_spec", ["redis"], indirect=True)
def test_a_lease_lost_before_the_loop_adopted_it_is_never_renewed(url: str, lock_name: str) -> None:
    """The loop adopts a lease granted in the body's thread lazily (within a second, for a
    long ttl): one lost meanwhile is not renewed once adopted, and its body still stops."""
    granted: queue.Queue[asynclock.Lease] = queue.Queue()
    checked = threading.Event()

    def body() -> None:
        with hold(thread, url, lock_name, ttl=60.0) as lease:
            granted.put(lease)
            with contextlib.suppress(asynclock.LeaseLost):  # swallowed: raised again at exit
                deadline = time.monotonic() + WAIT
                while time.monotonic() < deadline:
                    pass  # pure Python: the async exception lands between bytecodes
            checked.wait(WAIT)  # still inside the hold while the test looks

    with LoopThread() as thread:
        backend = thread.backend(url)
        outcome: list[BaseException] = []
        runner = threading.Thread(target=lambda: _catch(body, outcome))
        with loop_frozen(thread):  # the adoption cannot run before the loss
            runner.start()
            lease = granted.get(timeout=WAIT)
            # (Off the loop, which is frozen: nothing else touches the session now.)
            asynclock.testing.force_loss(lease, "lost early")
        try:
            # The loop has run the adoption now (stats() runs what is left for it): the
            # lost lease is not among those it renews, though its body is not over.
            assert thread.run(_settled_stats(backend)).held == 0
        finally:
            checked.set()
            runner.join(WAIT)
        assert not runner.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], asynclock.LeaseLost), outcome
        assert "lost early" in str(outcome[0])
        assert thread_free_check(url, lock_name) is None  # released all the same


@pytest.mark.parametrize("url_spec", ["redis"], indirect=True)
def test_a_queued_waiter_is_not_overtaken_by_the_body_thread(url: str, lock_name: str) -> None:
    """The blocking attempt respects the fair queue: a body arriving while another backend
    waits in line for the name gets it only after that waiter."""
    order: list[tuple[str, int]] = []

    async def wait_in_line(backend: asynclock.Backend) -> None:
        lease = await backend.acquire(lock_name, ttl=5.0, timeout=WAIT)
        order.append(("waiter", lease.token))
        await lease.release()

    with LoopThread() as thread, LoopThread() as other:
        first = thread.run(thread.backend(url).acquire(lock_name, ttl=5.0))
        waiting = asyncio.run_coroutine_threadsafe(wait_in_line(other.backend(url)), other.loop)
        wait_for(lambda: queue_length(url, lock_name) == 1)
        thread.run(first.release())  # the name is handed to the waiter, reserved for it
        with hold(thread, url, lock_name, ttl=5.0, timeout=WAIT) as mine:
            order.append(("body", mine.token))
        waiting.result(WAIT)
    assert [who for who, _ in order] == ["waiter", "body"], order
    assert order[0][1] < order[1][1]


# -- helpers ------------------------------------------------------------------------------


WAIT = 20.0
T = TypeVar("T")


def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def test_after_a_server_restart_the_body_thread_reconnects_before_it_asks(
    redis_factory: RedisFactory, lock_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen as a user would, after a Redis restart (data kept): the body thread's own
    connection was closed by the old server. Its next release and its next acquire must
    not fail on it (a WARNING "release ... not confirmed" for a lease released fine, and
    an acquire sent to the loop): an idle connection the server closed is made again."""
    server = redis_factory(persist=True)
    url = server.url
    caplog.set_level(logging.DEBUG, logger="asynclock")
    with LoopThread() as thread:
        thread.backend(url)
        with hold(thread, url, lock_name, ttl=5.0) as first:
            server.restart(keep_data=True)  # the lease survives it (appendfsync always)
            assert thread_free_check(url, lock_name) == first.token
        assert first.released and not first.lost
        assert thread_free_check(url, lock_name) is None
        server.restart(keep_data=True)
        with hold(thread, url, lock_name, ttl=5.0) as second:
            assert thread_free_check(url, lock_name) == second.token > first.token
        assert second.released and not second.lost
    complaints = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING or "asking the loop" in r.getMessage()
    ]
    assert complaints == []


def thread_free_check(url: str, name: str) -> int | None:
    """The token the server has for ``name`` now (None: nobody holds it)."""
    with _redis(url) as client:
        value = client.get(keys_for(name).lock)
    return None if value is None else token_of(value)


def queue_length(url: str, name: str) -> int:
    with _redis(url) as client:
        return int(client.zcard(keys_for(name).queue))


def wait_for(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _catch(body: Callable[[], None], outcome: list[BaseException]) -> None:
    try:
        body()
    except BaseException as exc:
        outcome.append(exc)


async def _settled_stats(backend: asynclock.Backend) -> asynclock.BackendStats:
    """The backend's stats once the loop has run what it was posted (FIFO: one more
    callback round after them)."""
    await asyncio.sleep(0)
    return backend.stats()


def test_a_body_holds_the_lease_and_releases_it(url: str) -> None:
    with LoopThread() as thread:
        with hold(thread, url, "job:1", ttl=5.0) as lease:
            assert asynclock.current_lease() is lease
            backend = thread.backend(url)
            assert thread.run(backend.validate("job:1", lease.token))
        assert lease.released
        # The same backend for the same URL, and the name is free again.
        assert thread.backend(url) is backend
        assert not thread.run(backend.locked("job:1"))
        with pytest.raises(asynclock.LockHeld):
            with hold(thread, url, "job:2", ttl=5.0):
                with hold(thread, url, "job:2", ttl=5.0, blocking=False):
                    pytest.fail("granted twice")


def test_a_lost_lease_stops_a_sleeping_body_on_the_main_thread(url: str) -> None:
    assert threading.current_thread() is threading.main_thread()
    with LoopThread() as thread:
        started = time.monotonic()
        with pytest.raises(asynclock.LeaseLost, match="forced here"):
            with hold(thread, url, "main", ttl=5.0) as lease:
                thread.call(asynclock.testing.force_loss, lease, "forced here")
                time.sleep(30)  # a blocking call: the signal's handler ends it
        assert time.monotonic() - started < 10


def test_a_lost_lease_stops_a_python_loop_in_another_thread(url: str) -> None:
    outcome: list[BaseException | None] = []
    with LoopThread() as thread:

        def worker() -> None:
            try:
                with hold(thread, url, "other", ttl=5.0) as lease:
                    thread.call(asynclock.testing.force_loss, lease, "forced there")
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        pass  # pure Python: the async exception lands between bytecodes
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        runner = threading.Thread(target=worker)
        runner.start()
        runner.join(20)
        assert not runner.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], asynclock.LeaseLost), outcome
    assert "forced there" in str(outcome[0])


def test_a_body_that_swallows_the_loss_still_fails(url: str) -> None:
    with LoopThread() as thread:
        with pytest.raises(asynclock.LeaseLost):
            with hold(thread, url, "swallow", ttl=5.0) as lease:
                thread.call(asynclock.testing.force_loss, lease, "forced")
                with contextlib.suppress(asynclock.LeaseLost):  # swallowed: raised again
                    time.sleep(30)


def test_a_backend_object_is_opened_on_the_thread_and_closed_with_it(url: str) -> None:
    backend = asynclock.connect(url)
    with LoopThread() as thread:
        assert thread.backend(backend) is backend
        kept = thread.run(backend.acquire("kept", ttl=5.0))  # held when the thread closes
        with hold(thread, backend, "obj", ttl=5.0) as lease:
            assert lease.token > 0
    assert lease.released
    assert kept.lost.reason == "backend closed"  # closing the thread closed the backend
    assert backend.held() == []


# -- the four names: guard, idempotent, a coroutine under a hold, the deprecated rest --------


def test_only_four_names_and_the_old_ones_import_with_a_warning() -> None:
    import asynclock.from_thread as from_thread

    assert from_thread.__all__ == ("LoopThread", "guard", "hold", "idempotent")
    for name in ("Handover", "BodyGuard", "run_body", "stop_on_loss", "CLOSE_TIMEOUT"):
        with pytest.warns(DeprecationWarning, match=f"from_thread.{name} is deprecated"):
            assert getattr(from_thread, name) is not None
    with pytest.raises(AttributeError):
        from_thread.Nothing  # type: ignore[attr-defined]  # noqa: B018


def test_guard_stops_a_pool_threads_body_and_leaves_a_kept_lease_alone(url: str) -> None:
    """``with guard(lease, loop)`` in a thread pool: the lease (held on the loop thread)
    is current inside; its loss interrupts the body, whose block raises LeaseLost even if
    it swallowed the interruption; a lease lost already is LeaseLost before the body."""
    with LoopThread() as thread, concurrent.futures.ThreadPoolExecutor(2) as pool:
        backend = thread.backend(url)
        kept = thread.run(backend.acquire("kept", ttl=5.0))
        lost = thread.run(backend.acquire("lost", ttl=5.0))

        def body(lease: asynclock.Lease, lose: bool) -> str:
            with guard(lease, thread.loop):
                assert asynclock.current_lease() is lease
                if lose:
                    thread.call(asynclock.testing.force_loss, lease, "taken over")
                    with contextlib.suppress(asynclock.LeaseLost):  # swallowed: raised again
                        deadline = time.monotonic() + WAIT
                        while time.monotonic() < deadline:
                            time.sleep(0.005)
            return "done"

        assert pool.submit(body, kept, False).result(WAIT) == "done"
        with pytest.raises(asynclock.LeaseLost, match="taken over") as info:
            pool.submit(body, lost, True).result(WAIT)
        assert type(info.value) is asynclock.LeaseLost
        with pytest.raises(asynclock.LeaseLost, match="taken over"):
            pool.submit(body, lost, False).result(WAIT)  # lost already: never entered
        assert not kept.lost
        thread.run(kept.release())


def test_guard_cancels_a_coroutine_on_another_loop(url: str) -> None:
    with LoopThread() as thread:
        backend = thread.backend(url)
        lease = thread.run(backend.acquire("co", ttl=5.0))
        reached: list[str] = []

        async def job() -> None:
            async with guard(lease, thread.loop):
                assert asynclock.current_lease() is lease
                thread.loop.call_soon_threadsafe(asynclock.testing.force_loss, lease, "gone")
                await asyncio.sleep(WAIT)  # cancelled
                reached.append("after the sleep")

        with pytest.raises(asynclock.LeaseLost, match="gone"):
            asyncio.run(job())
        assert reached == []


@pytest.mark.parametrize("where", ["main", "other"])
def test_a_coroutine_body_inside_a_hold_is_cancelled_and_its_loop_stays_usable(
    url: str, where: str
) -> None:
    """Celery's async tasks: a hold around ``guard(lease, loop).run(runner, body)``. A
    loss while the coroutine runs cancels it (never a signal or an async exception inside
    the runner's loop), one before it starts is LeaseLost before the loop runs, the hold
    raises LeaseLost, and the runner runs the next body as if nothing happened (no task of
    the lost one left on it)."""
    outcome: list[object] = []

    def run(thread: LoopThread) -> None:
        with asyncio.Runner() as runner:
            for n, when in enumerate(("during", "before", "never")):
                try:
                    with hold(thread, url, f"co:{n}", ttl=5.0) as lease:

                        async def body(lease: asynclock.Lease = lease, when: str = when) -> str:
                            assert asynclock.current_lease() is lease
                            if when == "during":
                                thread.call(asynclock.testing.force_loss, lease, "lost")
                                await asyncio.sleep(WAIT)
                            await asyncio.sleep(0)
                            return "returned"

                        if when == "before":
                            thread.call(asynclock.testing.force_loss, lease, "lost first")
                        outcome.append(guard(lease, thread.loop).run(runner, body))
                except asynclock.LeaseLost as exc:
                    outcome.append(f"LeaseLost: {exc.reason}")
                outcome.append(len(asyncio.all_tasks(runner.get_loop())))

    with LoopThread() as thread:
        if where == "main":
            run(thread)
        else:
            in_thread(lambda: run(thread))
    assert outcome == ["LeaseLost: lost", 0, "LeaseLost: lost first", 0, "returned", 0]


def test_idempotent_runs_once_replays_and_hands_the_outcome_back(url: str, lock_name: str) -> None:
    """``with idempotent(...) as op``: the first body runs under the key's lease and its
    saved result is replayed; an error frees the key (or is stored: store_errors); a result
    save() refuses raises there and frees the key."""

    class Declined(Exception):
        pass

    ran: list[str] = []

    def call(key: str, what: str) -> object:
        with idempotent(thread, url, key, ttl=5.0, store_errors=(Declined,)) as op:
            if op.replayed:
                return ("replayed", op.result)
            assert asynclock.current_lease() is op.lease
            ran.append(what)
            if what == "boom":
                raise RuntimeError("boom")
            if what == "declined":
                raise Declined("no funds")
            op.save({"ok": what, "token": op.token} if what != "refused" else {1: "x"})
        return ("ran", op.result)

    with LoopThread() as thread:
        first = call(f"{lock_name}:a", "first")
        assert first == ("ran", {"ok": "first", "token": first[1]["token"]})  # type: ignore[index]
        assert call(f"{lock_name}:a", "again") == ("replayed", first[1])
        with pytest.raises(RuntimeError, match="boom"):
            call(f"{lock_name}:b", "boom")
        assert call(f"{lock_name}:b", "second") == ("ran", {"ok": "second", "token": ANY_TOKEN})
        with pytest.raises(Declined):
            call(f"{lock_name}:c", "declined")
        with pytest.raises(asynclock.ReplayedFailure, match="no funds"):
            call(f"{lock_name}:c", "never")
        with pytest.raises(TypeError, match="dict key 1"):
            call(f"{lock_name}:d", "refused")
        assert call(f"{lock_name}:d", "then") == ("ran", {"ok": "then", "token": ANY_TOKEN})
        assert thread.backend(url).held() == []
    assert ran == ["first", "boom", "second", "declined", "refused", "then"]


def test_idempotent_stops_a_body_whose_lease_is_lost_and_stores_nothing(
    url: str, lock_name: str
) -> None:
    with LoopThread() as thread:
        with pytest.raises(asynclock.LeaseLost, match="forced"):
            with idempotent(thread, url, lock_name, ttl=5.0) as op:
                assert op.lease is not None
                thread.call(asynclock.testing.force_loss, op.lease, "forced")
                time.sleep(WAIT)  # the main thread: the signal's handler ends it
                op.save("never")
        with idempotent(thread, url, lock_name, ttl=5.0) as again:
            assert not again.replayed  # nothing was stored: the key runs again
            assert again.lease is not None and again.token > op.token


class _AnyToken:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0


ANY_TOKEN = _AnyToken()
