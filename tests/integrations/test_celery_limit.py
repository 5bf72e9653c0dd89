"""Issue 42 item 5: ``lock_limit=N`` in real ``celery worker`` processes: two prefork
workers (2 children each, so 4 runs could overlap) on one Redis broker, permits on Redis
and on SQLite; at most N runs of a key are ever in their body at once, fleet-wide."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.integrations import celery_tasks as tasks
from tests.integrations.test_celery_worker import configure_client, lock_url_for, send
from tests.support.celery_worker import (
    CeleryWorker,
    celery_redis,  # noqa: F401  (fixture)
    redis_db,
    start_celery_worker,
)
from tests.support.redis_servers import RedisServer

WAIT = 60.0


@pytest.fixture(scope="module", params=["redis", "sqlite"])
def fleet(
    request: pytest.FixtureRequest,
    celery_redis: RedisServer,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[CeleryWorker]]:
    directory = tmp_path_factory.mktemp(f"limit-{request.param}")
    url = lock_url_for(request.param, celery_redis, directory)
    configure_client(celery_redis)
    workers: list[CeleryWorker] = []
    try:
        for n in range(2):
            where = directory / f"w{n}"
            where.mkdir()
            workers.append(
                start_celery_worker(
                    celery_redis, where, pool="prefork", concurrency=2, lock_url=url, ttl=6.0
                )
            )
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def test_lock_limit_bounds_the_runs_of_a_key_across_workers(
    fleet: list[CeleryWorker],
    celery_redis: RedisServer,  # noqa: F811
) -> None:
    """8 runs of one key over two workers (4 children), lock_limit=2, on_busy="wait": all
    succeed, never more than 2 in their body at once, each on a slot 0 or 1, the tokens of
    each slot strictly increasing; and the limit is used (2 at once was seen)."""
    key = uuid.uuid4().hex[:10]
    results = [send(tasks.limited, fleet[n % 2], key, n) for n in range(8)]
    outcomes: list[Any] = [r.get(timeout=WAIT) for r in results]
    assert [r.state for r in results] == ["SUCCESS"] * 8
    seen = [
        int(x) for x in redis.Redis.from_url(redis_db(celery_redis, 3)).lrange(f"most:{key}", 0, -1)
    ]
    assert len(seen) == 8 and max(seen) == tasks.LIMITED_LIMIT, seen
    assert all(inside <= tasks.LIMITED_LIMIT for inside, _, _ in outcomes)
    assert {slot for _, slot, _ in outcomes} <= set(range(tasks.LIMITED_LIMIT))
    for slot in range(tasks.LIMITED_LIMIT):
        tokens = sorted(token for _, s, token in outcomes if s == slot)
        assert len(tokens) == len(set(tokens)), outcomes  # never the same token twice


def test_lock_limit_full_follows_on_busy_skip(fleet: list[CeleryWorker]) -> None:
    """lock_limit=1, on_busy="skip": a run that finds the one permit held is skipped
    (SUCCESS, None) on the other worker; the holder then runs to its end."""
    key = uuid.uuid4().hex[:10]
    holder = send(tasks.limited_skip, fleet[0], key)
    fleet[0].expect("limited_skip_started", key=key, timeout=WAIT)
    try:
        skipped = send(tasks.limited_skip, fleet[1], key)
        assert skipped.get(timeout=WAIT) is None
        assert skipped.state == "SUCCESS"
    finally:
        fleet[0].go(key)
    assert holder.get(timeout=WAIT) == "ran"


def test_lock_limit_options_are_checked_where_declared() -> None:
    from asynclock_celery import LockedTask, locked

    for bad in (0, -1, 10_001, True, 2.0, "2"):
        with pytest.raises((TypeError, ValueError), match="lock_limit"):
            type("Bad", (LockedTask,), {"lock_limit": bad, "__module__": __name__})
        with pytest.raises((TypeError, ValueError), match="limit"):
            locked("x", limit=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="idempotent"):
        type("Both", (LockedTask,), {"lock_limit": 2, "idempotent": True, "__module__": __name__})
