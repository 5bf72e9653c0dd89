"""Worker processes for stories, tests, benchmarks and drills (private).

One implementation of what the demo (``asynclock demo``), the suite (``tests/support``) and
the benchmarks need from real OS processes, and what ``asynclock drill`` builds on:

* :mod:`.process` — start a worker (``python -m module ...``, running the same asynclock as
  the parent), read its JSON events from its stdout pipe (every read is bounded), send it
  lines, pause/resume/kill it (SIGSTOP/SIGCONT/SIGKILL), and kill what is left on exit;
  the child side's :func:`emit` writes those events.
* :mod:`.history` — what the workers did, as holds and fenced writes, and the checker:
  overlapping believed holds, fencing tokens out of order, lost updates, stale writes the
  resource accepted. A history reads and writes as JSON lines.
"""

from __future__ import annotations

from .history import (
    Hold,
    Write,
    check,
    lost_updates,
    overlaps,
    read_jsonl,
    stale_writes,
    tokens_out_of_order,
    write_jsonl,
)
from .process import (
    Worker,
    WorkerFailed,
    WorkerGroup,
    die_with_parent,
    emit,
    kill_leftovers,
    process_state,
    spawn,
    worker_env,
)

__all__ = (
    "Hold",
    "Worker",
    "WorkerFailed",
    "WorkerGroup",
    "Write",
    "check",
    "die_with_parent",
    "emit",
    "kill_leftovers",
    "lost_updates",
    "overlaps",
    "process_state",
    "read_jsonl",
    "spawn",
    "stale_writes",
    "tokens_out_of_order",
    "worker_env",
    "write_jsonl",
)
