"""examples/fastapi_app.py and the docs' whole app run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.asgi_servers import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs" / "integrations" / "fastapi.md"


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


def test_fastapi_idempotent_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "fastapi_idempotent.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        'first: 201 {"order":"7","charge":1,"token":1}',
        'retry: 201 {"order":"7","charge":1,"token":1} (Idempotent-Replayed: true)',
        "same bytes: True",
        "same key, another amount: 422",
        "no key: 400",
    ]
    assert "Traceback" not in done.stderr


def docs_app() -> str:
    """The ``python`` block the FastAPI page marks as tested (its whole app)."""
    text = DOCS.read_text()
    marker = "<!-- tested by tests/integrations/test_fastapi_example.py -->\n```python\n"
    assert text.count(marker) == 1
    return text.split(marker, 1)[1].split("```", 1)[0]


def test_the_docs_app_runs_under_uvicorn_as_the_docs_say(tmp_path: Path) -> None:
    source = docs_app()
    assert source.startswith("# app.py; run it with: uvicorn app:app\n")
    (tmp_path / "app.py").write_text(source)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}/reports/2024-05-01"
        give_up = time.monotonic() + 30
        while True:  # polling for readiness: uvicorn offers no other signal to a parent
            try:
                first = httpx.post(url, timeout=10)
                break
            except httpx.ConnectError:
                assert server.poll() is None, server.stderr.read() if server.stderr else ""
                assert time.monotonic() < give_up, "uvicorn did not start in 30s"
                time.sleep(0.05)
        second = httpx.post(url, timeout=10)
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert first.status_code == 200 and first.json() == {"token": 1}
    assert second.json() == {"token": 2} and second.headers["Fencing-Token"] == "2"
    assert "Traceback" not in err.decode()
