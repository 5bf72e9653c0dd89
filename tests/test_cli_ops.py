"""``asynclock holder / list / break / watch`` against the suite's real servers: an operator
in another process looks at a lock this process holds, breaks it, and the holder is
fenced off; bad options and unreachable servers get clear errors, never a password."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynclock
from asynclock import _cli
from asynclock._core.owner_label import label_tag
from tests.support.redis_servers import RedisFactory
from tests.support.spec import BackendSpec

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


async def cli(*args: str) -> tuple[int, str, str]:
    """``python -m asynclock._cli ARGS`` in a process of its own: (exit code, out, err)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-m", "asynclock._cli", *args], env=env, check=False
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


# Every kind of server once (etcd3 is etcd's 3-node cluster: the same commands).
@pytest.mark.parametrize(
    "shared_spec",
    ["sqlite", "postgres", "postgres_lease", "redis", "redlock", "etcd", "zookeeper"],
    indirect=True,
)
async def test_an_operator_sees_the_holder_lists_it_and_breaks_it(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    spec = shared_spec
    url = spec.url
    label = "billing-worker:7"
    async with spec.connect(owner_label=label) as backend:
        with pytest.raises(asynclock.LeaseLost):
            async with backend.lock(lock_name, ttl=2.0) as lease:
                code, out, err = await cli("holder", lock_name, "--url", url, "--json")
                assert code == 0, err
                seen = json.loads(out)
                assert seen["held"] is True and seen["name"] == lock_name
                if backend.driver.tells_owner:
                    assert (seen["owner"], seen["token"]) == (lease.owner, lease.token)
                    assert seen["label"] == label, seen  # which process, from its owner
                elif spec.id == "postgres":  # mode=session: who holds it, and its token
                    assert seen["label"] is None, seen  # an advisory lock stores no value
                    assert seen["token"] == lease.token, seen
                    assert "held by PostgreSQL session pid " in seen["detail"], seen
                assert seen["ttl_left"] is None or 0 < seen["ttl_left"] <= 2.0

                code, out, err = await cli("list", "*" + lock_name[-8:], "--url", url, "--json")
                if not spec.can("names"):  # the server cannot enumerate them: it says why
                    assert "cannot list lock names" in err, (code, err)
                    # (PostgreSQL's session mode lists its permits and holds all the same)
                    assert code == (0 if spec.can("holds") else 2), (code, err)
                else:
                    assert code == 0, err
                    listed = json.loads(out)
                    assert [(h["name"], h["label"]) for h in listed] == [(lock_name, label)]

                if spec.id == "postgres":  # what the break did, in words (issue 39.4)
                    code, out, err = await cli("break", lock_name, "--yes", "--url", url)
                    assert code == 0, err
                    said = " ".join(out.split())
                    assert f"was token {lease.token}" in said, said
                    assert "asynclock ended PostgreSQL session pid " in said, said
                    assert "every other lock and open transaction of that session" in said
                else:
                    code, out, err = await cli("break", lock_name, "--yes", "--url", url, "--json")
                    assert code == 0, err
                    assert json.loads(out)["broken"] is True
                assert "requested by" in err and lock_name in err  # who broke it, logged
                # Fenced off: the token is no longer the live one, and the holder's body is
                # cancelled at its next renewal (this block then raises LeaseLost).
                assert not await backend.validate(lock_name, lease.token)
                with anyio.fail_after(30):
                    await anyio.sleep_forever()
        async with backend.lock(lock_name, ttl=2.0) as after:
            assert after.token > lease.token
    code, out, err = await cli("holder", lock_name, "--url", url)
    assert code == 1, err
    assert "free: nobody holds it" in out


@pytest.mark.parametrize("spec", ["sqlite", "redis"], indirect=True)
async def test_watch_prints_each_change_of_holder(spec: BackendSpec, lock_name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "asynclock._cli", "watch", lock_name, "--url", spec.url]
    command += ["--json", "--count", "3", "--interval", "0.05"]
    async with spec.connect() as backend, await anyio.open_process(command, env=env) as proc:
        assert proc.stdout is not None
        lines = _lines(proc.stdout)
        with anyio.fail_after(30):
            assert (await anext(lines))["held"] is False
            async with backend.lock(lock_name, ttl=5.0) as lease:
                granted = await anext(lines)
            freed = await anext(lines)
            assert await proc.wait() == 0
    assert (granted["held"], granted["token"], granted["owner"]) == (True, lease.token, lease.owner)
    assert granted["label"] == backend.owner_label  # default host:pid
    assert freed["held"] is False


async def _lines(stream: Any) -> Any:
    buffered = b""
    async for chunk in stream:
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            yield json.loads(line)


def test_bad_options_say_what_is_wrong(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ASYNCLOCK_URL", raising=False)
    sqlite = f"sqlite:///{tmp_path / 'locks.db'}"
    cases = [
        (["holder", "x"], "no lock server: give --url URL or set ASYNCLOCK_URL"),
        (["holder", "x", "--url", "memory://"], "keeps locks inside one process"),
        (["holder", "x", "--url", "nosuch://h"], "--url:"),
        (["holder", "", "--url", sqlite], "NAME: lock name must be a non-empty str"),
        (["list", "--limit", "0", "--url", sqlite], "must be from 1 to 100000"),
        (["watch", "x", "--interval", "0", "--url", sqlite], "from 0.05 to 60 seconds"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exited:
            _cli.main(argv)
        assert exited.value.code == 2, argv
        assert words in capsys.readouterr().err, argv


def test_break_without_a_terminal_asks_for_yes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exited:
        _cli.main(["break", "x", "--url", f"sqlite:///{tmp_path / 'l.db'}"])
    assert exited.value.code == 2
    assert "refusing to break 'x' without --yes: no terminal to ask on" in capsys.readouterr().err


def test_an_unreachable_server_is_exit_3_and_no_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = _cli.main(["holder", "x", "--url", "redis://:hunter2-pw@127.0.0.1:1/0"])
    err = capsys.readouterr().err
    assert code == 3
    assert "redis://127.0.0.1:1/0" in err and "hunter2" not in err


def test_a_name_nobody_holds_is_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    assert _cli.main(["holder", "nobody", "--url", url, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["held"] is False
    assert _cli.main(["break", "nobody", "--yes", "--url", url]) == 1
    assert "nothing to break" in capsys.readouterr().out


async def test_on_a_just_started_redis_the_restart_grace_is_named(
    redis_factory: RedisFactory,
) -> None:
    """Documented defaults, a server that just started: before any acquire nobody holds
    the name and no grace is set yet (its length is the first ttl asked for); once a
    worker has asked, ``holder`` names the restart grace instead of calling the name free
    (and ``list`` shows nothing held)."""
    url = redis_factory(fresh=True).url
    code, out, err = await cli("holder", "x", "--url", url)
    assert (code, out.split("\n")[1].strip()) == (1, "free: nobody holds it"), err
    async with asynclock.connect(url) as backend:
        with pytest.raises(asynclock.RestartGrace):
            await backend.acquire("x", ttl=30.0, blocking=False)
    code, out, err = await cli("holder", "x", "--url", url)
    assert code == 1, err
    assert "not granted before" in out and "restart grace" in out, out
    code, out, err = await cli("list", "--url", url)
    assert code == 0 and "no held lock matches '*'" in out, err


@pytest.mark.parametrize("spec", ["sqlite", "redis"], indirect=True)
async def test_holders_lists_user_locks_not_idempotency_keys(
    spec: BackendSpec, lock_name: str
) -> None:
    async with spec.connect() as backend:
        async with (
            backend.lock(lock_name, ttl=5.0) as lease,
            backend.idempotent(lock_name, ttl=5.0) as op,
        ):
            assert not op.replayed
            found = await backend.holders("*" + lock_name[-8:])
            assert [(h.name, h.token) for h in found] == [(lock_name, lease.token)]


#: A name chosen to drive a terminal: clear the screen, set the window title, a C1 CSI,
#: a bidi override, a carriage return and a forged line of output.
HOSTILE = "job\x1b[2J\x1b]0;pwned\x07\x9b31m\u202eevil\r\nFORGED: free, nobody holds it"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def _clean(text: str) -> None:
    assert not any(ch in text for ch in RAW), repr(text)
    assert not any(line.lstrip().startswith("FORGED") for line in text.splitlines()), text


@pytest.mark.parametrize("spec", ["sqlite", "redis"], indirect=True)
async def test_human_output_escapes_every_control_character_of_a_name(
    spec: BackendSpec, lock_name: str
) -> None:
    """``holder``, ``list``, ``watch`` and ``break`` write names as ``ls`` and ``git`` do:
    every control character visible as an escape, never acted on by the terminal."""
    name = f"{lock_name[-8:]}:{HOSTILE}"  # short enough to be shown whole
    async with spec.connect() as backend:
        # A stored label with control characters (connect() refuses them, but a server's
        # value can be written by anything): the owner as another client would store it.
        backend._acq.label_tag = label_tag("lbl\x1b]0;pwned\x07")
        with pytest.raises(asynclock.LeaseLost):
            async with backend.lock(name, ttl=2.0):
                commands: list[tuple[str, str]] = [
                    ("holder", name),
                    ("list", f"{lock_name[-8:]}*"),
                    ("watch", name),
                ]
                for args in commands:
                    extra = ("--count", "1") if args[0] == "watch" else ()
                    code, out, err = await cli(*args, *extra, "--url", spec.url)
                    assert code == 0, (args, err)
                    _clean(out + err)
                    assert "\\x1b[2J" in out, out  # shown, escaped
                    # The label too (whole, but in a table squeezed by the long name).
                    shown = "lbl\\x1" if args[0] == "list" else "lbl\\x1b]0;pwned\\x07"
                    assert shown in out, out
                code, out, err = await cli("break", name, "--yes", "--url", spec.url)
                assert code == 0, err
                _clean(out + err)
                with anyio.fail_after(30):
                    await anyio.sleep_forever()


def test_plain_output_escapes_too(capsys: pytest.CaptureFixture[str]) -> None:
    from asynclock._cli.output import Output

    out = Output(color=False)
    out.line([(HOSTILE, "")])
    out.paragraph([(HOSTILE, "")], "  ", "  ")
    out.table("t", [("name", "<")], [[HOSTILE]])
    out.verdict(True, HOSTILE, [HOSTILE])
    _clean(capsys.readouterr().out)


async def test_an_unreachable_zookeeper_says_so_once_without_kazoos_own_lines() -> None:
    from asynclock._harness.servers import free_port

    code, _, err = await cli("holder", "x", "--url", f"zookeeper://127.0.0.1:{free_port()}")
    assert code == 3, err
    assert err.splitlines() == [err.strip()] and err.startswith("asynclock holder: "), err


@pytest.mark.parametrize("spec", ["sqlite"], indirect=True)
async def test_list_shows_partitions_with_their_member(spec: BackendSpec, lock_name: str) -> None:
    """``asynclock list 'GROUP/*'`` shows a group's member and partition locks, each with
    the member id it belongs to (the identity in its owner tag), in text and in JSON."""
    group = f"group-{lock_name[-8:]}"  # short: the table fits 120 columns
    async with (
        spec.connect() as backend,
        backend.partitions(group, count=2, ttl=5.0) as member,
    ):
        pattern = f"{group}/*"
        code, out, err = await cli("list", pattern, "--url", spec.url)
        assert code == 0, err
        rows = [line for line in out.splitlines() if f"{group}/" in line]
        # (a narrow table cuts long cells short: the id's start; --json has all of it)
        assert len(rows) == 3 and all(member.id[:16] in row for row in rows), out
        assert "identity / member" in out  # the column says what the id is
        code, out, err = await cli("list", pattern, "--url", spec.url, "--json")
        assert code == 0, err
        listed = json.loads(out)
        assert [(h["name"], h["identity"]) for h in listed] == [
            (f"{group}/member/{member.id}", member.id),
            (f"{group}/partition/0", member.id),
            (f"{group}/partition/1", member.id),
        ]
