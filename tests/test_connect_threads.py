"""``asynclock.connect()`` from several threads at once, in fresh interpreters (issue 39.5):
a thread pool warming ``redis://`` and ``redlock://`` together imported the Redis package
and its ``redlock`` submodule in opposite orders, and one thread died in an import
deadlock (``_DeadlockError``; half of the fresh interpreters here, before the fix)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RACE = """
import sys, threading
import asynclock
barrier = threading.Barrier(2)
errors = []
def connect(url):
    barrier.wait()
    try:
        asynclock.connect(url)
    except BaseException as exc:
        errors.append(repr(exc))
urls = ["redis://127.0.0.1:1/0", "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]
threads = [threading.Thread(target=connect, args=(u,)) for u in urls[::int(sys.argv[1])]]
for t in threads: t.start()
for t in threads: t.join()
print(errors)
"""


@pytest.mark.timeout(120)
def test_two_threads_connecting_to_redis_and_redlock_at_once_both_succeed() -> None:
    for run in range(8):  # each fresh interpreter: nothing imported yet; both orders
        done = subprocess.run(
            [sys.executable, "-c", RACE, "1" if run % 2 else "-1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert done.stdout.strip() == "[]", (run, done.stdout, done.stderr)
