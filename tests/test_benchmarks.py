"""Benchmarks are scripts, not tests; this only checks that the SQLite one still runs
(``--quick``) and checks its own exclusion, and that every benchmark starts both as a module
(``python -m benchmarks.bench_x``) and as a script, so they cannot rot unnoticed. No timing
asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
NAMES = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py"))


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["module", "script"])
@pytest.mark.parametrize("name", NAMES)
def test_benchmark_starts(name: str, form: str, tmp_path: Path) -> None:
    """``--help`` imports everything the benchmark needs; the script runs from elsewhere."""
    if form == "module":
        command, cwd = [sys.executable, "-m", f"benchmarks.{name}", "--help"], ROOT
    else:
        command, cwd = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"], tmp_path
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_benchmarks_do_not_edit_sys_path() -> None:
    """They import the project as installed (editable) by ``uv sync``, like the tests do."""
    for name in NAMES:
        assert "sys.path" not in (BENCHMARKS / f"{name}.py").read_text(), name


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


@pytest.mark.timeout(60)
def test_idempotency_benchmark_smoke_run() -> None:
    """Its three tables on SQLite and Redis at small sizes: each key's body ran once, every
    duplicate got the stored result, no stale save landed (the script exits 1 otherwise)."""
    script = str(BENCHMARKS / "bench_idempotency.py")
    done = subprocess.run(
        [sys.executable, script, "--quick", "--backends", "sqlite,redis", "--loop", "asyncio"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for backend in ("sqlite", "redis"):
        a, b, c = [line.split() for line in done.stdout.splitlines() if line.startswith(backend)]
        assert a[1:3] == ["60", "1"] and a[4] == "0", done.stdout  # calls, runs/key, other
        assert b[1:4] == ["2", "2", "2"] and b[4:7] == ["0", "/", "2"], done.stdout
        assert len(c) == 6, done.stdout
