"""The Spin models (tests/models/*.pml, docs/proved.md): designs hold, weaker variants fail.

A weaker variant that passes means the model checks nothing (its property holds vacuously), so
it fails the test as surely as a violated design does. Without ``spin`` and ``gcc`` the tests
skip locally and fail in CI (``CI`` set), where .ci/run installs both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.models import run as models

RUNS = [
    pytest.param(model, flag, id=f"{model.file}-{flag or 'design'}")
    for model in models.MODELS
    for flag in ((None,) if model.design_in_suite else ()) + tuple(f for f, _ in model.weaker)
]


def test_the_designs_left_out_here_are_checked_by_ci() -> None:
    """A design too slow for the suite (``design_in_suite=False``) is checked by .ci/run,
    which runs tests/models/run.py: every model, every variant, and fails on any surprise."""
    assert [m.file for m in models.MODELS if not m.design_in_suite] == ["lease.pml", "redlock.pml"]
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "\npython3 tests/models/run.py\n" in ci


@pytest.fixture(scope="module")
def tools() -> None:
    missing = models.tools_missing()
    if not missing:
        return
    message = f"{', '.join(missing)} not found: Debian's spin and gcc (.ci/run installs them)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "flag"), RUNS)
def test_model(tools: None, model: models.Model, flag: str | None) -> None:
    result = models.check(model, flag)
    if flag is None:
        assert result.errors == 0, f"{model.file} violates {result.violated}:\n{result.output}"
    else:
        assert result.errors > 0, f"{model.file} -D{flag}: no violation found, the model is vacuous"
    assert result.states > 0


def test_runner_exit_code(tools: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's exit code says whether every result was the expected one."""
    good = models.Result("m.pml", "design", 0, 10, 3, 0.0, "", "")
    vacuous = models.Result("m.pml", "WEAK", 0, 10, 3, 0.0, "", "")
    monkeypatch.setattr(models, "check_all", lambda: [good])
    assert models.main([]) == 0
    monkeypatch.setattr(models, "check_all", lambda: [good, vacuous])
    assert models.main([]) == 1
