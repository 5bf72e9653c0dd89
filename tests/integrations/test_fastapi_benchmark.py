"""benchmarks/bench_fastapi.py still runs (``--quick``); no timing asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(120)
def test_fastapi_benchmark_smoke_run() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_fastapi.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for route in ("plain", "guard", "manual", "write", "fenced"):
        assert f"\n  {route} " in done.stdout
    assert "guard / manual" in done.stdout
