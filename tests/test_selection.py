"""One backend's tests alone: `-m NAME` and `--backend NAME` (tests/support/selection.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=50,
        check=False,
    )


def ids(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [["--backend", "sqlite"], ["-m", "sqlite"]])
def test_one_backend_alone(how: list[str]) -> None:
    chosen = ids(collect(*how, "tests/conformance", "tests/backends"))
    files = {line.split("::", 1)[0] for line in chosen}
    assert "tests/backends/test_sqlite.py" in files
    assert "tests/conformance/test_loss.py" in files  # conformance params count too
    for line in chosen:
        assert line.startswith("tests/backends/test_sqlite.py") or "[sqlite" in line, line


@pytest.mark.timeout(60)
def test_a_family_marker_takes_every_mode() -> None:
    chosen = ids(collect("-m", "postgres", "tests/conformance/test_tokens.py"))
    assert any("[postgres_lease" in line for line in chosen)
    assert any("[postgres]" in line or "[postgres-" in line for line in chosen)
    assert not any("[redis" in line or "[sqlite" in line for line in chosen)


@pytest.mark.timeout(60)
def test_unknown_backend_is_a_usage_error() -> None:
    result = collect("--backend", "nosuch", "tests/conformance/test_tokens.py")
    assert result.returncode == 4
    assert "--backend nosuch: no such backend; choose from memory, sqlite" in result.stderr
