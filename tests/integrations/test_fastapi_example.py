"""examples/fastapi_app.py runs as a user would run it and shows both sides of the fence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_fastapi_app_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "fastapi_app.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("rebuild: 200 {'total': 200, 'token': 1}")
    assert lines[1].startswith("rebuild while held: 409 busy")
    assert lines[2] == "other holder wrote total=7 with token 2"
    assert lines[3] == "late write with token 1: 412 (stale, nothing written)"
    assert lines[4] == "write without a token: 428"
    assert lines[5] == "ledger: balance 42 = 7"
    assert "Traceback" not in done.stderr
