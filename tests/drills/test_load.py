"""Load on every backend: 200 concurrent tasks over 50 names, no errors, no leaks.

Each task takes a name (four tasks share each), holds it briefly, and gives it back, a few
times over. Afterwards the backend holds no lease, every acquisition was released, no
lease was lost, no task is left over, and once the backend is closed the process has no
more open file descriptors (connections) than before. Peak RSS goes to the test's report
(``-rA`` shows it). The 30-second version is ``python -m benchmarks.bench_drill --load``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from tests.support.redis_servers import wait_until
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

TASKS, NAMES, ROUNDS = 200, 50, 3


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_200_tasks_over_50_names_leave_nothing_behind(
    spec: BackendSpec, lock_name: str, record_property: Callable[[str, object], None]
) -> None:
    names = [f"{lock_name}-{i}" for i in range(NAMES)]
    # What a driver library sets up once per process (etcd's client: its own pool and
    # resolver) is not a leak: count descriptors after a first open and close.
    async with spec.connect() as first:
        await first.locked(names[0])
    fds_before = open_fds()
    done = 0
    with anyio.fail_after(55):
        async with spec.connect() as backend:

            async def worker(i: int, rounds: int = ROUNDS) -> None:
                nonlocal done
                for r in range(rounds):
                    async with backend.lock(names[(i + r) % NAMES], ttl=10.0, timeout=45):
                        await anyio.lowlevel.checkpoint()
                        done += 1

            # Warm up: a backend starts its long-lived helpers (a release listener per
            # node, say) on first use; what must not grow is what the load leaves behind.
            async with anyio.create_task_group() as tg:
                for i in range(2 * NAMES):
                    tg.start_soon(worker, i % 10, 1)
            tasks_before, done = len(asyncio.all_tasks()), 0
            async with anyio.create_task_group() as tg:
                for i in range(TASKS):
                    tg.start_soon(worker, i)
            stats = backend.stats()
            assert done == TASKS * ROUNDS
            assert stats.held == 0
            assert stats.acquired == stats.released == TASKS * ROUNDS + 2 * NAMES
            assert stats.losses == 0, stats.loss_reasons
            # No task left over. A call the last releases started may still be finishing
            # (etcd: a watch cancel written on its stream, a grpc call's own task): wait
            # for those, bounded; a task that stays is a leak.
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, timeout=10)
            assert len(asyncio.all_tasks()) <= tasks_before, asyncio.all_tasks()
            for name in names[:5]:
                assert not await backend.locked(name)
    # Closed: every connection is given back. Redis' sockets close a few loop iterations
    # after aclose() returns (the transports' close callbacks), so wait for that, bounded.
    with contextlib.suppress(TimeoutError):
        await wait_until(lambda: open_fds() <= fds_before, timeout=10)
    assert open_fds() <= fds_before, f"{open_fds() - fds_before} descriptors left open"
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record_property("peak_rss_mb", round(peak_mb, 1))
    print(
        f"{spec.id}: {TASKS}x{ROUNDS} holds over {NAMES} names; process peak RSS {peak_mb:.1f} MB"
    )
