"""An efficiency lock: a duplicate only wastes work, so a lease without a fence is enough.

Three workers (three backends, as three processes would be) are asked to rebuild the same
report. The first takes ``report:daily`` with ``blocking=False`` and rebuilds; the others
find it held (``LockHeld``) and skip: the work is done once instead of three times.

A lease can end under a holder that is still running (a long pause past its ttl), and
then a second worker rebuilds too. Here that is harmless, and this is what makes it an
efficiency lock: each rebuild writes a complete report to a temporary file and renames
it over the old one (an atomic replace), so two rebuilds at once cost work, never a
broken report. If a duplicate could corrupt something (a balance, a ledger, a file
written in place), the lock is not enough: check its token at the resource
(examples/fencing.py), or use an idempotency key (examples/idempotency.py).

Run: uv run python examples/efficiency_lock.py [URL]   (default: a SQLite file in a temp dir)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import anyio

import asynclock
import asynclock.testing

REBUILDS: list[str] = []
CONTENT = "".join(f"line {i}\n" for i in range(1000))


def rebuild(report: Path, worker: str) -> None:
    """Write the whole report beside the old one, then replace it in one step."""
    REBUILDS.append(worker)
    part = report.with_name(f"{report.name}.{worker}.part")
    part.write_text(CONTENT)
    os.replace(part, report)


async def rebuild_unless_busy(
    backend: asynclock.Backend,
    worker: str,
    report: Path,
    held: anyio.Event | None = None,
    go: anyio.Event | None = None,
) -> None:
    try:
        async with backend.lock("report:daily", ttl=5.0, blocking=False):
            print(f"{worker} rebuilds the report")
            if held is not None and go is not None:
                held.set()
                await go.wait()  # still rebuilding while the others ask
            rebuild(report, worker)
    except asynclock.LockHeld:
        print(f"{worker} skips: another worker is rebuilding it")


async def main(url: str, report: Path) -> None:
    async with (
        asynclock.connect(url) as a,
        asynclock.connect(url) as b,
        asynclock.connect(url) as c,
    ):
        with anyio.fail_after(30):
            held, go = anyio.Event(), anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(rebuild_unless_busy, a, "worker-a", report, held, go)
                await held.wait()
                await rebuild_unless_busy(b, "worker-b", report)
                await rebuild_unless_busy(c, "worker-c", report)
                go.set()
            print(f"rebuilds: {len(REBUILDS)} (3 workers asked)")

            # The lease ends under a holder that is still running: a duplicate rebuild.
            stalled = await a.acquire("report:daily", ttl=0.5)
            asynclock.testing.force_loss(stalled, "pretend a long pause")  # stops renewing
            print(f"worker-a stalls past its ttl; its lease is lost: {stalled.lost.reason}")
            async with b.lock("report:daily", ttl=5.0, timeout=10):
                print("worker-b rebuilds the report")
                rebuild(report, "worker-b")
            print("worker-a finishes its rebuild late")  # nothing stops it: it wastes work
            rebuild(report, "worker-a")
            await stalled.release()  # a reported no-op: the lease is already lost
    whole = await anyio.Path(report).read_text() == CONTENT
    print(f"rebuilds: {len(REBUILDS)}; the report is whole: {whole}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        default = f"sqlite:///{Path(tmp) / 'locks.db'}"
        anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else default, Path(tmp) / "report.txt")
