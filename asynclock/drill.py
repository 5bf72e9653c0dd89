"""A partition and pause drill against a real lock deployment, with a checked history.

:func:`run` starts worker processes that loop *acquire → read a shared register → a little
work → write register + 1 through the fence with the lease's token → release*, injects
faults while they run, and checks the recorded history when they stop::

    import asynclock.drill

    report = asynclock.drill.run(spawn="redis", workers=4, duration=10)
    assert report.ok, report.problems        # 0 lost updates, tokens in order

Faults (loopback only): ``pause`` (SIGSTOP a holder past its TTL with its write on the
way, SIGCONT it once a successor has written), ``partition`` (a TCP proxy between each
worker and the lock servers, switched to blackhole or added latency for one worker),
``kill`` (kill -9 a holder and start a new worker in its lane; with ``spawn=`` every
other kill is a lock server's: a lone server is restarted at once, a cluster's node at the
next server kill), ``clock`` (one worker's clock runs fast or slow, through the injectable
:class:`~asynclock.Clock`); when asked for, ``restart`` (a lock server killed and started
again without its data: the restart grace) and ``failover`` (``spawn="redis-sentinel"``: a
holder cut off from the sentinels, then ``SENTINEL FAILOVER``; ``"redis-cluster"``:
``CLUSTER FAILOVER FORCE``).

The register is a real store: a SQLite row (``sqlite``, ``etcd``), a Redis key (``redis``,
``redlock``) or a PostgreSQL row (``postgresql``). With ``spawn=`` it lives on a server of
its own, so a lock server can be killed while the fenced resource stays up; with ``url=``
it is on your (first) server. With ``fence=False`` the same schedule runs unfenced, and the
report shows the updates that were lost.

``asynclock drill`` is the same run from the command line; it prints a summary table and
writes ``history.jsonl``, ``report.json`` and one self-contained ``report.html`` (an SVG
timeline: a lane per worker, lease bars, fault markers, rejected writes in red).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from ._harness import write_jsonl
from ._harness.deployment import SPAWN, check_url, deployment
from ._harness.report import DrillReport, Fault, judge
from ._harness.schedule import ALL_FAULTS, FAULTS, Drill, Progress

__all__ = (
    "ALL_FAULTS",
    "FAULTS",
    "SPAWN",
    "DrillReport",
    "Fault",
    "check_url",
    "run",
    "run_async",
    "save",
)


def _check(workers: int, duration: float, ttl: float, faults: Sequence[str]) -> None:
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 256:
        raise ValueError(f"workers must be an int from 1 to 256, got {workers!r}")
    for label, value, low in (("duration", duration, 0.5), ("ttl", ttl, 0.05)):
        if not isinstance(value, (int, float)) or not (low <= value <= 86400):
            raise ValueError(
                f"{label} must be a number of seconds from {low} to 86400, got {value!r}"
            )
    unknown = [f for f in faults if f not in ALL_FAULTS]
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; allowed: {', '.join(ALL_FAULTS)}")


async def run_async(
    url: str | None = None,
    *,
    spawn: str | None = None,
    workers: int = 4,
    duration: float = 10.0,
    faults: Sequence[str] = FAULTS,
    fence: bool = True,
    ttl: float = 0.5,
    report_dir: str | os.PathLike[str] | None = None,
    allow_remote_faults: bool = False,
    progress: Progress | None = None,
    seed: int | None = None,
    fault_interval: float | None = None,
    work: float = 0.005,
    wait: bool = True,
) -> DrillReport:
    """:func:`run`, awaitable (inside your own event loop)."""
    faults = tuple(dict.fromkeys(faults))
    _check(workers, duration, ttl, faults)
    run_id = secrets.token_hex(4)
    name = f"asynclock-drill-{run_id}"
    with tempfile.TemporaryDirectory(prefix="asynclock-drill-") as tmp_name:
        tmp = Path(tmp_name)
        where = deployment(url, spawn, faults, allow_remote_faults, tmp, run_id, wait)
        async with where as dep:
            report = DrillReport(dep.kind, dep.url, fence, workers, duration, ttl)
            if dep.kind == "sqlite" and "partition" in faults:
                report.skipped.append("partition: SQLite has no network to partition")
            report.skipped += _inapplicable(dep, faults)
            rng = random.Random(seed)
            drill = Drill(
                dep,
                report,
                name=name,
                workers=workers,
                faults=faults,
                fence=fence,
                ttl=ttl,
                tmp=tmp,
                progress=progress,
                rng=rng,
                interval=fault_interval,
                work=work,
            )
            await drill.run(duration)
        judge(report)
        if report_dir is not None:
            save(report, Path(report_dir))
    return report


def _inapplicable(dep: Any, faults: Sequence[str]) -> list[str]:
    """The faults asked for that this deployment cannot have, each with why."""
    out = []
    if "restart" in faults and not dep.servers:
        out.append("restart: only a lock server the drill started (--spawn) can be restarted")
    if "failover" in faults and dep.failover is None:
        out.append(
            "failover: only --spawn redis-sentinel and --spawn redis-cluster have replicas "
            "to promote"
        )
    return out


def run(url: str | None = None, **options: Any) -> DrillReport:
    """Run a drill and return its :class:`DrillReport` (``report.ok``: nothing was lost).

    Give either ``url`` (your deployment: ``sqlite:///...``, ``redis://...``,
    ``redlock://h1,h2,h3``, ``postgresql://...``; faults only against loopback hosts unless
    ``allow_remote_faults=True``) or ``spawn=`` one of :data:`SPAWN` (throwaway servers).

    Options: ``workers`` (processes, default 4), ``duration`` (seconds, default 10),
    ``faults`` (any of :data:`ALL_FAULTS`, default :data:`FAULTS`: pause, partition, kill,
    clock; ``restart`` and ``failover`` when asked for), ``fence`` (default True; False runs the
    same schedule unfenced), ``ttl`` (lease seconds, default 0.5), ``report_dir`` (write
    ``history.jsonl``, ``report.json`` and ``report.html`` there), ``progress`` (called
    about 4 times a second with (elapsed, planned, counters)), ``seed`` (which workers the
    faults hit), ``fault_interval`` (seconds between faults; default: spread over the run),
    ``wait`` (``spawn="redis-sentinel"``/``"redis-cluster"``: the workers ask for
    ``wait_replicas=1``; default True, False shows a failover's double grant).

    Raises ``ValueError`` for bad options, before anything starts.
    """
    return anyio.run(lambda: run_async(url, **options))


def save(report: DrillReport, directory: Path) -> None:
    """Write ``history.jsonl``, ``report.json`` and ``report.html`` into ``directory``."""
    from ._harness.report import render_html

    directory.mkdir(parents=True, exist_ok=True)
    history = directory / "history.jsonl"
    history.unlink(missing_ok=True)
    write_jsonl(history, [*report.holds, *report.writes])
    (directory / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (directory / "report.html").write_text(render_html(report), encoding="utf-8")
    report.report_dir = directory
