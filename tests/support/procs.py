"""Start tests/support/worker.py in real subprocesses, through asynclock's process harness.

Every read from a worker's pipe and every wait for its exit is bounded (``EVENT_TIMEOUT``,
generous for a loaded machine; each test's own timeout still applies), and a worker a
failed test left behind is killed after the test (``kill_leftovers``, from conftest).
"""

from __future__ import annotations

import json
from typing import Any

from asynclock._harness import Worker, kill_leftovers, spawn

from .spec import BackendSpec

__all__ = ("EVENT_TIMEOUT", "Worker", "kill_leftovers", "start_worker")

#: Bound on every read from a worker and on waiting for it to exit, in seconds.
EVENT_TIMEOUT = 30.0


async def start_worker(spec: BackendSpec, **config: Any) -> Worker:
    """Start a worker running ``config["mode"]`` against ``spec``'s server."""
    payload = json.dumps({"url": spec.url, "options": spec.options, **config})
    return await spawn(
        ["-m", "tests.support.worker", payload],
        label=f"{config.get('mode', 'test')} worker",
        timeout=EVENT_TIMEOUT,
    )
