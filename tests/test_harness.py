"""The process harness (asynclock._harness) shared by the demo, the suite and the benchmarks:
bounded reads from a worker's pipe, pause/resume/kill, and the history checker."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from asynclock._harness import (
    Hold,
    WorkerFailed,
    WorkerGroup,
    Write,
    check,
    kill_leftovers,
    lost_updates,
    overlaps,
    process_state,
    read_jsonl,
    servers,
    spawn,
    stale_writes,
    tokens_out_of_order,
    write_jsonl,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals"),
]

#: A worker that reports once, then echoes each line it is sent back as an event.
ECHO = (
    "import sys\n"
    "from asynclock._harness import emit\n"
    "emit('ready', pid_check=True)\n"
    "for line in sys.stdin:\n"
    "    emit('echo', text=line.strip())\n"
)


async def test_events_round_trip_and_carry_their_time() -> None:
    async with WorkerGroup() as group:
        worker = await group.start(["-c", ECHO], label="echo", timeout=20)
        ready = await worker.expect("ready")
        assert ready["pid_check"] is True and isinstance(ready["t"], float)
        await worker.send("hello")
        assert (await worker.expect("echo"))["text"] == "hello"
        with pytest.raises(WorkerFailed, match=r"echo reported .* when 'ready' was expected"):
            await worker.send("again")
            await worker.expect("ready")


async def test_every_read_is_bounded() -> None:
    async with WorkerGroup() as group:
        worker = await group.start(["-c", "import time; time.sleep(60)"], label="mute")
        with anyio.fail_after(10):
            with pytest.raises(WorkerFailed, match=r"mute: no report of 'ready' within 0.2s"):
                await worker.expect("ready", 0.2)
            assert await worker.wait(0.1) is None  # still running: the wait is bounded too


async def test_a_worker_that_exits_is_reported_with_its_stderr(tmp_path: Path) -> None:
    code = "import sys; sys.stderr.write('boom: it broke\\n'); sys.exit(4)"
    async with WorkerGroup() as group:
        worker = await group.start(["-c", code], label="w", stderr=tmp_path / "w.stderr")
        with anyio.fail_after(20):
            with pytest.raises(WorkerFailed) as info:
                await worker.expect("ready", 15, "its start")
    assert "w exited (code 4) before its start" in str(info.value)
    assert "boom: it broke" in str(info.value)


async def test_error_events_and_garbage_fail_loudly() -> None:
    code = "from asynclock._harness import emit; emit('error', message='no backend'); print('x')"
    async with WorkerGroup() as group:
        worker = await group.start(["-c", code], label="w")
        with pytest.raises(WorkerFailed, match="w: no backend"):
            await worker.expect("ready")
        with pytest.raises(WorkerFailed, match=r"w printed b'x' instead of an event"):
            await worker.next_event()


async def test_pause_resume_and_kill() -> None:
    async with WorkerGroup() as group:
        worker = await group.start(["-c", ECHO], label="echo", timeout=20)
        await worker.expect("ready")
        worker.pause()
        await worker.wait_stopped(10)
        if process_state(worker.pid) is not None:
            assert process_state(worker.pid) in ("T", "t")
        await worker.send("while paused")
        with pytest.raises(WorkerFailed, match="no report"):
            await worker.expect("echo", 0.3)
        worker.resume()
        assert (await worker.expect("echo"))["text"] == "while paused"
        worker.kill()
        assert await worker.wait() == -signal.SIGKILL


async def test_leftovers_are_killed_even_when_paused() -> None:
    worker = await spawn(["-c", "import time; time.sleep(60)"], label="left")
    worker.pause()
    await worker.wait_stopped(10)
    kill_leftovers()
    assert await worker.wait(20) == -signal.SIGKILL
    await worker.process.aclose()


def test_checker_accepts_a_clean_history() -> None:
    holds = [Hold("a", 0.0, 1.0, 1), Hold("b", 1.0, 2.0, 2), Hold("a", 2.5, 3.0, 3)]
    writes = [Write("a", 0.5, 1, True), Write("b", 1.5, 2, True), Write("a", 1.8, 1, False)]
    assert check(holds, writes, increments=3, final=3) == []


def test_checker_names_every_violation() -> None:
    holds = [
        Hold("a", 0.0, 2.0, 5, "n"),
        Hold("b", 1.0, 3.0, 5, "n"),  # overlaps a; same token
        Hold("c", 0.5, 0.7, 1, "other"),  # another name: no overlap with a
        Hold("a", 2.1, 2.2, 6, "n"),  # own hold inside b's: b is another worker
    ]
    assert [(x.worker, y.worker) for x, y in overlaps(holds)] == [("a", "b"), ("b", "a")]
    assert [(x.token, y.token) for x, y in tokens_out_of_order(holds)] == [(5, 5)]
    writes = [Write("b", 1.0, 6, True), Write("a", 2.0, 5, True), Write("a", 3.0, 4, False)]
    assert stale_writes(writes) == [writes[1]]
    assert lost_updates(100, 97) == 3
    problems = check(holds, writes, increments=100, final=97)
    assert len(problems) == 5
    assert any("b held n from 1.000000 while a held it until 2.000000" in p for p in problems)
    assert any("tokens did not increase: a held 5, then b got 5" in p for p in problems)
    assert any("a's write with stale token 5 was accepted" in p for p in problems)
    assert any("3 of 100 updates were lost (the counter reads 97)" in p for p in problems)


def test_records_read_back_from_json(tmp_path: Path) -> None:
    hold, write = Hold("a", 1.5, 2.5, 7, "n"), Write("b", 3.0, 8, False, "k")
    assert Hold.from_json(hold.to_json()) == hold
    assert Write.from_json(write.to_json()) == write
    assert hold.to_json()["kind"] == "hold" and write.to_json()["kind"] == "write"
    history = tmp_path / "history.jsonl"
    write_jsonl(history, [hold, write])
    write_jsonl(history, [hold])
    assert read_jsonl(history) == ([hold, hold], [write])
    history.write_text('{"kind": "nap"}\n')
    with pytest.raises(ValueError, match=r"history.jsonl:1: not a hold or write record"):
        read_jsonl(history)


async def test_sending_to_a_worker_that_is_gone_fails_clearly() -> None:
    async with WorkerGroup() as group:
        worker = await group.start(["-c", "pass"], label="gone")
        assert await worker.wait(20) == 0
        with pytest.raises(WorkerFailed, match=r"gone is gone \(code 0\): it cannot read 'go'"):
            for _ in range(100):  # the first writes may still land in the pipe's buffer
                await worker.send("go")


def test_server_ports_come_from_below_the_ephemeral_range_never_twice() -> None:
    """Outgoing connections get their local port from the kernel's ephemeral range, so a
    server port from that range can be taken by a client socket while a killed server is
    down for its restart ("Address already in use"); ports come from below it instead."""
    low = servers._ephemeral_low()
    assert low is not None  # Linux: /proc/sys/net/ipv4/ip_local_port_range
    ports = [servers.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(low - servers.PORT_SPAN <= port < low for port in ports), ports
