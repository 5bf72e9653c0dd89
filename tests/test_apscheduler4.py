"""The APScheduler 4 tests (tests/integrations/apscheduler4), in an environment of their own.

APScheduler 3 (this environment) and 4 share the import name ``apscheduler``, so the 4.x
tests run in ``.venv-apscheduler4`` (git-ignored), which this test builds from the frozen
lock (``--extra apscheduler4`` and the ``apscheduler4-test`` group, without the default dev
group that pulls APScheduler 3) and reuses afterwards. Warm: a few seconds; cold (an
empty uv cache) it downloads APScheduler 4 and its few dependencies first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests/integrations/apscheduler4"


def uv() -> list[str]:
    found = os.environ.get("UV") or shutil.which("uv")  # `uv run` sets UV
    if found:
        return [found]
    return ["python3", "-m", "uv"]  # the README's bootstrap: uv installed with pip


@pytest.mark.timeout(300)
def test_the_apscheduler4_integration_passes_its_tests_in_its_own_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["UV_PROJECT_ENVIRONMENT"] = str(ROOT / ".venv-apscheduler4")
    command = [
        *uv(),
        "run",
        "--frozen",
        "--no-default-groups",
        "--group",
        "apscheduler4-test",
        "--extra",
        "apscheduler4",
        "--python",
        f"{sys.version_info.major}.{sys.version_info.minor}",
        "python",
        "-m",
        "pytest",
        TESTS,
        "-q",
        "-x",
        "-n",
        "0",
        "--confcutdir",
        TESTS,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, output[-2000:]


def test_the_apscheduler4_integration_imports_only_the_public_api() -> None:
    package = ROOT / "integrations" / "asynclock_apscheduler4"
    sources = sorted(package.glob("*.py"))
    assert sources
    for source in sources:
        text = source.read_text()
        assert "asynclock._" not in text and "from asynclock." not in text, source.name
        # Importing the 3.x package would import APScheduler 3.
        assert "asynclock_apscheduler " not in text and "asynclock_apscheduler." not in text
