"""Every drill a test here runs is replayed against the models' invariants (issue 44).

The autouse fixture wraps :func:`asynclock.drill.run_async` (which ``run`` calls): each
report's history is written as JSON lines, read back, and checked by
:mod:`asynclock._harness.trace_check` (G1 with the drill's ttl, G2, G3), the same
statements the Spin models in tests/models check. A drill the drill's own judge passed
(``report.ok``) must pass the replay too; a drill it failed (no fence, a failover without
WAIT) may show problems, and the tests that make one assert which. The reports and their
replays are in ``drill_replays`` for those tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import asynclock.drill
from asynclock._harness import write_jsonl
from asynclock._harness.trace_check import check_file

_numbers = itertools.count()


@pytest.fixture(autouse=True)
def drill_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[asynclock.drill.DrillReport, list[str]]]]:
    replays: list[tuple[asynclock.drill.DrillReport, list[str]]] = []
    real = asynclock.drill.run_async
    where = tmp_path_factory.mktemp("replays")

    async def replayed(*args: Any, **options: Any) -> asynclock.drill.DrillReport:
        report = await real(*args, **options)
        history = where / f"history-{next(_numbers)}.jsonl"
        write_jsonl(history, [*report.holds, *report.writes])
        replays.append((report, replay(history, report.ttl)))
        return report

    monkeypatch.setattr(asynclock.drill, "run_async", replayed)
    yield replays
    for report, problems in replays:
        assert not (report.ok and problems), (
            f"the drill passed its own judge, its history fails the models' invariants: {problems}"
        )


def replay(history: Path, ttl: float) -> list[str]:
    """The trace check of a history file, at least one record in it."""
    assert history.stat().st_size > 0, history
    return check_file(history, ttl=ttl)
