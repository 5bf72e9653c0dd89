"""The ``asynclock`` pytest plugin in a separate pytest run per async test framework/mode:
pytest-asyncio strict and auto, and anyio's plugin (loaded through the entry point)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest
import asynclock
from asynclock.testing import force_loss

{marker}
async def test_lock_backend_gives_real_leases(lock_backend):
    assert lock_backend.driver.display.startswith("{scheme}")
    async with lock_backend.lock("plugin:x", ttl=5) as lease:
        assert asynclock.current_lease() is lease
        assert await lock_backend.validate("plugin:x", lease.token)

{marker}
async def test_force_loss_cancels_and_raises(lock_backend):
    reached = False
    with pytest.raises(asynclock.LeaseLost, match="forced"):
        async with lock_backend.lock("plugin:y", ttl=5) as lease:
            force_loss(lease, "forced here")
            await __import__("anyio").sleep(5)
            reached = True
    assert not reached
"""

CELERY_TEST = """
from celery import Celery
from asynclock_celery import LockedTask

app = Celery("plugin", broker="memory://", backend="cache+memory://")

@app.task(bind=True, base=LockedTask, lock="job:{n}")
def job(self, n):
    return [self.lease.name, self.request.fencing_token]

def test_locked_task_runner(locked_task_runner):
    name, token = locked_task_runner(job, (3,), throw=True).get()
    assert name == "job:3" and token >= 1
"""

MODES = {
    "asyncio-strict": ("[pytest]\nasyncio_mode = strict\n", "@pytest.mark.asyncio", "-p asyncio"),
    "asyncio-auto": ("[pytest]\nasyncio_mode = auto\n", "", "-p asyncio"),
    "anyio": ("[pytest]\n", "@pytest.mark.anyio", "-p no:asyncio"),
}


def run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("mode", sorted(MODES))
def test_plugin_under_each_framework(mode: str, tmp_path: Path) -> None:
    ini, marker, plugin = MODES[mode]
    (tmp_path / "pytest.ini").write_text(
        ini + "asyncio_default_fixture_loop_scope = function\n"
        if mode.startswith("asyncio")
        else ini
    )
    (tmp_path / "test_memory.py").write_text(
        textwrap.dedent(TESTS.format(marker=marker, scheme="memory"))
    )
    if mode == "anyio":
        (tmp_path / "conftest.py").write_text(
            "import pytest\n\n@pytest.fixture\ndef anyio_backend():\n    return 'asyncio'\n"
        )
    proc = run_pytest(tmp_path, *plugin.split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_asynclock_url_points_the_fixture_at_a_server(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    (tmp_path / "test_sqlite.py").write_text(
        textwrap.dedent(TESTS.format(marker="", scheme="sqlite"))
    )
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    proc = run_pytest(tmp_path, "-p", "asyncio", "--asynclock-url", url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_locked_task_runner_runs_a_task_with_a_real_lease(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_task.py").write_text(CELERY_TEST)
    proc = run_pytest(tmp_path, "-p", "no:asyncio")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
