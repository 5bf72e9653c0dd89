"""``asynclock drill`` from the command line, and its HTML report in a real headless browser.

The browser is Debian's Chromium (``.ci/run`` installs ``chromium``); the test renders the
report, reads back the DOM Chromium built, and checks one lane per worker, the lease bars,
the fault markers and the rejected write, then takes a screenshot.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from asynclock._harness import worker_env
from asynclock._harness.trace_check import check_file

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]  # fmt: skip
WORKERS = 3


def drill_cli(*args: str, timeout: float = 50) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asynclock._cli", "drill", "--no-color", *args],
        capture_output=True, text=True, timeout=timeout, env=worker_env(), check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("drill-report")
    result = drill_cli(
        "--spawn", "sqlite", "--workers", str(WORKERS), "--duration", "3", "--ttl", "0.3",
        "--faults", "pause,kill,clock", "--seed", "3", "--report", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Nothing was lost" in result.stdout
    assert "lost updates" in result.stdout and "stale writes rejected" in result.stdout
    return out


def test_cli_drill_writes_history_and_report(report_dir: Path) -> None:
    assert {p.name for p in report_dir.iterdir()} >= {"history.jsonl", "report.json", "report.html"}
    # The history replays clean against the models' invariants (G1 at the ttl, G2, G3).
    assert check_file(report_dir / "history.jsonl", ttl=0.3) == []


def test_cli_no_fence_exits_nonzero_and_says_what_was_lost() -> None:
    result = drill_cli(
        "--spawn", "sqlite", "--workers", "2", "--duration", "2", "--ttl", "0.3",
        "--faults", "pause", "--no-fence", "--seed", "1",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NO FENCE" in result.stdout and "were lost" in result.stdout


def test_the_reports_legend_names_only_the_faults_the_run_made(tmp_path: Path) -> None:
    """Partitions are skipped on SQLite (no network): the legend must not offer a colour
    for them (nor for kills or clock jumps, not asked for); the page says what was skipped."""
    result = drill_cli(
        "--spawn", "sqlite", "--workers", "2", "--duration", "2", "--ttl", "0.3",
        "--faults", "pause,partition", "--seed", "3", "--report", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    elements = _Elements()
    elements.feed((tmp_path / "report.html").read_text())
    made = {f["data-fault"] for f in elements.having("g", "fault")}
    assert made == {"pause"}
    assert [k["data-fault"] for k in elements.having("span", "fault-key")] == ["pause"]
    assert elements.having("p", "skipped")
    assert (
        "Not made here: partition: SQLite has no network" in (tmp_path / "report.html").read_text()
    )


def test_cli_spawn_zookeeper_kills_ensemble_members_and_loses_nothing() -> None:
    """``asynclock drill --spawn zookeeper``: a 3-member ensemble of its own, a member killed -9
    and rejoined, nothing lost with the fence."""
    result = drill_cli(
        "--spawn", "zookeeper", "--workers", "3", "--duration", "3", "--ttl", "0.3",
        "--faults", "pause,kill", "--seed", "5", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--spawn zookeeper" in result.stdout and "Nothing was lost" in result.stdout
    assert "lock node" in result.stdout or "node 127.0.0.1:" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "one of the arguments --url --spawn is required"),
        (["--spawn", "sqlite", "--faults", "flood"], "unknown fault 'flood'"),
        (["--spawn", "sqlite", "--workers", "0"], "must be from 1 to 256"),
        (["--url", "redis://10.9.8.7:6379/0"], "not a loopback address"),
        (["--url", "memory://"], "separate processes"),
    ],
)
def test_cli_bad_options_exit_2(args: list[str], message: str) -> None:
    result = drill_cli(*args, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def having(self, tag: str, cls: str) -> list[dict[str, str]]:
        return [a for t, a in self.found if t == tag and cls in a.get("class", "").split()]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("the report test needs Chromium (Debian package chromium; .ci/run installs it)")
    return found


def test_report_renders_lanes_and_markers_in_chromium(report_dir: Path, tmp_path: Path) -> None:
    page = (report_dir / "report.html").as_uri()
    base = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(
        [*base, "--dump-dom", page], capture_output=True, text=True, timeout=50, check=False
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    elements = _Elements()
    elements.feed(dom.stdout)
    lanes = elements.having("g", "lane")
    assert [lane["data-worker"] for lane in lanes] == [f"w{i + 1}" for i in range(WORKERS)]
    assert len(elements.having("rect", "lease")) > 10
    kinds = {f["data-fault"] for f in elements.having("g", "fault")}
    assert {"pause", "kill", "clock"} <= kinds
    assert elements.having("circle", "rejected"), "the paused holder's late write is not red"
    assert "PASS: nothing was lost" in dom.stdout
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [*base, "--window-size=1280,900", f"--screenshot={shot}", page],
        capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and shot.stat().st_size > 10_000, result.stderr[-2000:]
