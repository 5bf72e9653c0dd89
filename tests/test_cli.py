"""The ``asynclock`` command: ``demo`` plays the stale-holder story for real, options and errors."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import asynclock
from asynclock import _cli, _demo

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(60)

needs_sigstop = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")


def run_cli(*args: str, without_rich: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m asynclock._cli ARGS`` (optionally as if rich were not installed)."""
    if without_rich:
        # A None entry in sys.modules makes `import rich` raise ImportError.
        code = "import sys; sys.modules['rich'] = None; from asynclock._cli import main; "
        code += f"raise SystemExit(main({list(args)!r}))"
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "-m", "asynclock._cli", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    env.pop("NO_COLOR", None)
    return subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=50, check=False
    )


def flat(text: str) -> str:
    """Whitespace-normalised text, so checks don't depend on where lines wrap."""
    return " ".join(text.split())


@needs_sigstop
@pytest.mark.parametrize("without_rich", [False, True], ids=["rich", "plain"])
def test_demo_plays_the_story(without_rich: bool) -> None:
    result = run_cli("demo", "--no-color", without_rich=without_rich)
    out = flat(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "\x1b[" not in result.stdout  # --no-color, and not a terminal anyway
    # The narrative: tokens, the freeze, the loss, the rejection (fresh file: tokens 1, 2).
    assert "acquired 'ledger': token 1" in out
    assert "LockHeld" in out
    assert "freezes (SIGSTOP" in out
    assert "worker 2 acquired the lock: token 2 (> 1)" in out
    assert "raised LeaseLost (" in out
    assert "rejected: StaleToken (the fence has seen token 2); nothing written" in out
    # The timeline, in order.
    expected = [
        "froze worker 1 (SIGSTOP)",
        "worker 1's lease expired",
        "worker 2 2 acquired the lock",
        "worker 2 2 released the lock",
        "resumed worker 1 (SIGCONT)",
        "worker 1 1 LeaseLost:",
        "worker 1's late write rejected: StaleToken",
    ]
    positions = [out.find(text) for text in expected]
    assert -1 not in positions, [t for t, p in zip(expected, positions, strict=True) if p < 0]
    assert positions == sorted(positions)
    # The ledger: only the accepted writes.
    assert "fence high-water mark: token 2" in out
    assert "1 worker 1 1 100 opened" in out
    assert "2 worker 2 2 70 payment 30 (from 100)" in out
    assert " 90 " not in out.split("Ledger", 1)[1]
    assert "The story played out as told." in out
    if without_rich:
        assert "OK: The story played out as told." in result.stdout
        assert "╭" not in result.stdout


@needs_sigstop
def test_demo_on_a_given_sqlite_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    result = run_cli("demo", "--url", url, "--ttl", "0.5", without_rich=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert url in result.stdout
    assert "lease ttl 0.5 s" in result.stdout


def test_help_reads_well() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    assert "usage: asynclock" in top.stdout
    assert "demo" in top.stdout and "--version" in top.stdout
    # A pip user has no docs/ folder: the help names what an installed package has.
    assert "docs/ of the project" not in top.stdout
    assert "python -m pydoc asynclock " in top.stdout
    assert f"asynclock-{asynclock.__version__}.tar.gz" in top.stdout
    for module in ("asynclock", "asynclock.fence", "asynclock_fastapi"):
        doc = subprocess.run(
            [sys.executable, "-m", "pydoc", module],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert doc.returncode == 0 and f"Help on package {module}" in doc.stdout, doc.stderr

    demo = run_cli("demo", "--help")
    assert demo.returncode == 0
    text = flat(demo.stdout)
    for option in ("--url URL", "--ttl SECONDS", "--no-color"):
        assert option in text
    for word in ("SIGSTOP", "SIGCONT", "LeaseLost", "StaleToken", "token N+1", "SQLFence"):
        assert word in text
    assert "default: a temporary SQLite file" in text


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"asynclock {asynclock.__version__}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "gopher://example.org"], "unknown backend URL scheme 'gopher'"),
        (["--url", "memory://"], "memory:// keeps locks inside one process"),
        (["--url", "sqlite:///"], "sqlite URL needs a file path"),
        (["--ttl", "0"], "must be between 0.1 and 60 seconds"),
        (["--ttl", "soon"], "must be a number of seconds"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], message: str) -> None:
    result = run_cli("demo", *args)
    assert result.returncode == 2
    assert "usage: asynclock demo" in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_no_command_prints_help() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "demo" in result.stdout


def test_without_sigstop_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delattr(signal, "SIGSTOP", raising=False)
    assert _cli.main(["demo"]) == 2
    assert "has no SIGSTOP" in capsys.readouterr().err


@needs_sigstop
def test_a_deviation_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def derail(story: _demo.Story, say: _demo.Say) -> None:
        raise _demo.Deviation("worker 1 exited (code 1) before worker 1 acquiring the lock")

    monkeypatch.setattr(_demo, "play", derail)
    monkeypatch.setattr(_demo, "make_output", _demo.Output)  # plain text, no colors
    assert _cli.main(["demo"]) == 1
    out = capsys.readouterr().out
    assert "DEVIATION: The story did not play out as told:" in out
    assert "worker 1 exited (code 1)" in out


def test_check_names_every_deviation() -> None:
    story = _demo.Story(url="sqlite:///x.db", ttl=1.0, ledger="ledger.db", name="ledger")
    story.token1, story.token2 = 5, 5
    story.expires_at, story.w2_acquired_at = 10.0, 9.5
    story.resumed_at, story.lost_at = 20.0, 25.0
    story.late_accepted = True
    story.rows = [_demo.LedgerRow(1, "worker 1", 5, 100, "opened")]
    story.mark = 5
    problems = _demo.check(story)
    assert any("tokens did not increase" in p for p in problems)
    assert any("before worker 1's lease expired" in p for p in problems)
    assert any("LeaseLost came 5000 ms after" in p for p in problems)
    assert any("late write was not rejected" in p for p in problems)
    assert any("the ledger holds" in p for p in problems)


def test_console_script_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'asynclock = "asynclock._cli:main"' in text


def test_a_registered_command_plugs_in(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The registry is how `drill` and `stats` will join `demo`: parser, help and run."""
    from asynclock._cli import registry

    monkeypatch.setattr(registry, "COMMANDS", dict(registry.COMMANDS))
    monkeypatch.setattr(_cli, "COMMANDS", registry.COMMANDS)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--times", type=int, default=1)

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        print("hello " * args.times)
        return 7

    hello = registry.Command("hello", "say hello", "Say hello.", "", add_arguments, run)
    registry.register(hello)
    with pytest.raises(ValueError, match="'hello' is registered twice"):
        registry.register(hello)
    assert _cli.main(["hello", "--times", "2"]) == 7
    assert "hello hello" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    text = capsys.readouterr().out
    assert "demo" in text and "say hello" in text
