"""Benchmarks are scripts, not tests; this only checks that the SQLite one still runs
(``--quick``) and checks its own exclusion, so it cannot rot unnoticed. No timing asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.timeout(120)
def test_sqlite_benchmark_smoke_run() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_sqlite.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "asynclock sqlite://: overlaps: 0" in done.stdout


@pytest.mark.timeout(120)
def test_apscheduler_benchmark_smoke_run() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_apscheduler.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("sqlite  "))
    # No occurrence ran twice, and the fenced ledger's tokens rise with the run time.
    assert row.split()[2] == "0" and row.split()[-1] == "True", done.stdout
