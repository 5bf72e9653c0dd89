"""The mixed read-write stress run (issue 42): readers and writers, each on a backend (a
connection, an owner) of its own, on one rwlock for ~5 s on SQLite and Redis. The 60 s run
is ``python -m benchmarks.bench_rwlock`` (same function, its table)."""

from __future__ import annotations

import pytest

from benchmarks.bench_rwlock import BOUND, stress, table
from tests.support.spec import BackendSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.mark.parametrize("spec", ["sqlite", "redis"], indirect=True)
async def test_mixed_readers_and_writers(spec: BackendSpec, lock_name: str) -> None:
    report = await stress(spec.url, 5.0, readers=8, writers=3, name=lock_name)
    shown = table([report], BOUND)
    print(shown)
    # Never a reader beside a writer, nor two writers; writer tokens strictly increase;
    # every reader holds the epoch of the last write (shared by all readers of that epoch).
    assert report.overlaps == 0, shown
    assert report.token_violations == 0 and report.epoch_violations == 0, shown
    assert report.lost == 0, shown
    # Both modes made progress, and no writer waited past the bound (writer preference).
    assert report.reads_per_s > 5 and report.writes_per_s > 5, shown
    assert report.max_wait <= BOUND, shown
