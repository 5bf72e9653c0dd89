"""Every example runs, as a user would run it, and says what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_basic() -> None:
    out = run("basic.py")
    assert "holding 'report:daily' with token 1" in out
    assert "token 2 (always larger)" in out
    assert "second holder refused" in out


def test_fencing() -> None:
    out = run("fencing.py")
    assert "late write rejected" in out
    assert "ledger: token 2: second holder" in out
    ledger = [line for line in out.splitlines() if line.startswith("ledger:")]
    assert ledger == ["ledger: token 1: first holder, on time", "ledger: token 2: second holder"]


def test_stuck_holder() -> None:
    out = run("stuck_holder.py")
    assert "held by token 1" in out
    assert "broken: True" in out
    assert "stuck run stopped: renewal refused" in out
    assert "next run got token 2 (larger" in out
    assert "still locked: False" in out


def test_leadership() -> None:
    out = run("leadership.py")
    assert out.splitlines() == [
        "node-a leads with token 1",
        "operator breaks the lock: True",
        "node-a lost its term (token 1): renewal refused: lease row gone or taken over",
        "node-a campaigns again",
        "node-a leads with token 2",
        "node-a leads again with token 2 (larger than 1)",
    ]


def test_apscheduler_cluster() -> None:
    out = run("apscheduler_cluster.py")
    summary = out.splitlines()[-1]
    assert "each once: True; tokens rise: True" in summary, out
    assert int(summary.split()[0]) >= 2, out  # ran for a few one-second occurrences


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_a_test(example: str) -> None:
    tested = Path(__file__).read_text() + "".join(
        p.read_text() for p in Path(__file__).parent.rglob("test_*.py")
    )
    assert f'"{example}"' in tested, f"examples/{example} is not run by any test"
