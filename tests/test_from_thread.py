"""asynclock.from_thread: a lease held around a synchronous body, the body stopped when
the lease is lost (a signal on the main thread, an async exception elsewhere)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

import asynclock
import asynclock.testing
from asynclock.from_thread import LoopThread, hold


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


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
