"""A redelivery storm (issue 24, "Bad input and faults"): many concurrent duplicates of a
few idempotency keys, each body must run once and every duplicate get its stored result.

This is one process of ``benchmarks/bench_idempotency.py``'s table A (which runs four):
250 concurrent duplicates of each of 20 keys, ``wait=60``, given 20 s. It failed on SQLite
and Redis before (found by that benchmark; PostgreSQL failed with four processes): every
waiting duplicate waited for the key's *lock*, so each release woke all of a key's waiters
in the process and each retried the lock (a thundering herd: about n² attempts for n
duplicates). The backend's connection was swamped: calls timed out
(``BackendUnavailable``), the running body's renewal was starved (its lease lost, the body
run again), or nothing finished in time. Now a process's duplicates of a key wait for the
one call of it that takes the lock, then read the record once.
"""

from __future__ import annotations

import collections
import uuid

import anyio
import pytest

from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

KEYS, DUPLICATES = 20, 250


@pytest.fixture(params=["sqlite", "redis"])
def storm_spec(request: pytest.FixtureRequest) -> BackendSpec:
    result: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return result


@pytest.mark.timeout(60)
async def test_a_redelivery_storm_runs_each_body_once_and_replays_to_all(
    storm_spec: BackendSpec,
) -> None:
    keys = [f"storm:{uuid.uuid4().hex[:8]}:{i}" for i in range(KEYS)]
    runs: collections.Counter[str] = collections.Counter()
    results: dict[str, list[object]] = collections.defaultdict(list)
    errors: list[Exception] = []
    async with storm_spec.connect() as backend:

        async def call(key: str) -> None:
            try:
                async with backend.idempotent(key, ttl=10.0, wait=60.0) as op:
                    if not op.replayed:
                        runs[key] += 1
                        await anyio.sleep(0.2)  # the duplicates arrive while it runs
                        await op.save(f"result of {key}")
                    results[key].append(op.result)
            except Exception as exc:
                errors.append(exc)

        with anyio.move_on_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(DUPLICATES):
                    for key in keys:
                        tg.start_soon(call, key)
    assert not errors, f"{len(errors)} errors, e.g. {errors[0]!r}"
    assert dict(runs) == dict.fromkeys(keys, 1)
    assert dict(results) == {k: [f"result of {k}"] * DUPLICATES for k in keys}
