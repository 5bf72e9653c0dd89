"""``connect(url, owner_label=...)`` (issue 39 item 4): what a process calls itself, read
back by others from the owner the server stores. The servers' side is in
``conformance/test_holder_extend_break.py`` (every backend) and ``test_cli_ops.py``."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import anyio
import pytest

import asynclock

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "bad",
    ["", "x" * 101, "é" * 51, "job\x1b[2J", "a\nFORGED", "tab\t", "\x9bc1", "bidi\u202e", "\ud800"],
)
def test_a_bad_label_is_refused_at_connect_saying_what_is_allowed(bad: str) -> None:
    with pytest.raises(ValueError, match="1 to 100 bytes of UTF-8 with no control"):
        asynclock.connect("memory://", owner_label=bad)


def test_a_label_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="owner_label must be a str or None"):
        asynclock.connect("memory://", owner_label=b"web-1")  # type: ignore[arg-type]


def test_the_default_is_host_colon_pid_and_100_bytes_fit() -> None:
    assert asynclock.connect("memory://").owner_label == f"{socket.gethostname()}:{os.getpid()}"
    assert asynclock.connect("memory://", owner_label="é" * 50).owner_label == "é" * 50


def test_holder_stays_positional_and_reads_the_label_from_its_owner() -> None:
    bare = asynclock.Holder("n", "ab" * 16, 3, 1.0)
    assert bare.label is None  # an owner without a label (another client, an old asynclock)
    tagged = asynclock.Holder("n", "ab" * 16 + "~" + "wörker".encode().hex(), 3, 1.0)
    assert tagged.label == "wörker"
    assert asynclock.Holder("n", "ab" * 16 + "~zz", 3, 1.0).label is None  # not hex: none
    assert asynclock.Holder("n", None, None, None, None, None, "given").label == "given"


@pytest.mark.parametrize("url", ["memory://", "sqlite"])
async def test_lock_held_names_the_holders_label(url: str, tmp_path: Path) -> None:
    """Memory and SQLite read the holder's row in their busy answer: LockHeld says who."""
    if url == "sqlite":
        url = f"sqlite:///{tmp_path / 'l.db'}"
    async with asynclock.connect(url, owner_label="report-runner:9") as backend:
        held, done = anyio.Event(), anyio.Event()

        async def hold() -> None:
            async with backend.lock("report", ttl=5):
                held.set()
                await done.wait()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await held.wait()
                with pytest.raises(asynclock.LockHeld) as raised:
                    async with backend.lock("report", ttl=5, blocking=False):
                        pass
                done.set()
    assert raised.value.label == "report-runner:9"
    assert "held by another owner ('report-runner:9')" in str(raised.value)
    again = pickle.loads(pickle.dumps(raised.value))
    assert (again.label, str(again)) == (raised.value.label, str(raised.value))


async def test_leadership_keeps_its_identity_beside_the_label() -> None:
    async with asynclock.connect("memory://", owner_label="web-1") as backend:
        with anyio.fail_after(10):
            async for term in backend.leadership("leader", ttl=5, identity="a.b~c"):
                async with term:
                    leader = await backend.leader("leader")
                    held = await backend.holder("leader")
                break
    assert leader is not None and leader.identity == "a.b~c"
    assert held is not None and held.label == "web-1"
