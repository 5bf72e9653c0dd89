"""ttl / max_hold advice from measured holds (issue 26, part 3) and the ``stats`` / ``advise``
commands against a real second process (part 2): the sketch's error bound, the numbers from
holds and renewal lag controlled through a ManualClock, real round trips on sqlite, the
warnings once per template, bounded memory, and the CLI's answers and exit codes."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynclock
from asynclock._core import advice as adv
from asynclock._core.sketch import HIGH, LOW, RELATIVE_ERROR, SKETCH_BYTES, LogHistogram
from asynclock._ops.serve import fetch, parse_address
from asynclock.testing import ManualClock, next_renewal_round
from tests.support.spec import BackendSpec
from tests.test_cli_ops import cli

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


# -- the sketch ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=LOW, max_value=HIGH / 2), min_size=1, max_size=300),
    st.floats(min_value=0.0, max_value=1.0),
)
def test_a_quantile_is_within_the_stated_relative_error(values: list[float], q: float) -> None:
    sketch = LogHistogram()
    for v in values:
        sketch.add(v)
    ordered = sorted(values)
    exact = ordered[max(1, math.ceil(q * len(ordered))) - 1]  # nearest rank
    got = sketch.quantile(q)
    assert abs(got - exact) <= RELATIVE_ERROR * exact * (1 + 1e-9), (got, exact)
    assert sketch.count == len(values) and sketch.max == max(values)


def test_the_sketch_has_fixed_memory_and_clamps_out_of_range_values() -> None:
    sketch = LogHistogram()
    size = len(sketch.counts) * sketch.counts.itemsize
    assert size == SKETCH_BYTES < 1500
    for v in (0.0, -1.0, float("nan"), 1e-9, 1e9):
        sketch.add(v)
    assert len(sketch.counts) * sketch.counts.itemsize == size
    assert sketch.quantile(0.0) == LOW and sketch.max == 1e9
    with pytest.raises(ValueError, match="q must be from 0 to 1"):
        sketch.quantile(1.5)
    assert RELATIVE_ERROR < 0.044


# -- advice from controlled holds ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory", "sqlite"], indirect=True)
async def test_advice_numbers_from_controlled_holds_and_renewal_lag(
    spec: BackendSpec, lock_name: str
) -> None:
    clock = ManualClock(1000.0)
    async with spec.connect(clock=clock) as backend:
        backend.collect_advice(name_template=lambda name: name.rsplit(":", 1)[0] + ":*")
        early = backend.advise(f"{lock_name}:0")
        assert not early.enough and early.samples == 0
        assert "not enough samples: 0 of 100 holds" in early.reasoning
        assert "0 of 20 renewal rounds" in early.reasoning
        # 20 renewal rounds, each woken 0.5 s late (ttl 9: due every 3 s; advanced 3.5).
        # First: a renewer woken from its idle nap by a clock that jumped would count the
        # jump as lag (a real clock does not jump).
        async with backend.lock(f"other-{lock_name}", ttl=9.0):
            for _ in range(20):
                clock.advance(3.5)
                with anyio.fail_after(10):
                    await next_renewal_round(backend)
        for i in range(1, 101):  # holds of 0.01 .. 1.00 s: p99 (nearest rank) = 0.99 s
            async with backend.lock(f"{lock_name}:{i}", ttl=60.0):
                clock.advance(i / 100)
        advice = backend.advise(f"{lock_name}:7")
    assert advice.template == f"{lock_name}:*" and advice.enough
    assert advice.samples == 100 and advice.renewal_samples == 20
    assert abs(advice.hold_p99 - 0.99) <= RELATIVE_ERROR * 0.99
    assert advice.hold_max == pytest.approx(1.0)
    assert advice.max_hold == adv._round_up(5 * advice.hold_p99)
    assert 4.7 <= advice.max_hold <= 5.2
    # The manual clock stands still during a round trip; the lag is the 0.5 s overshoot.
    assert advice.round_trip_p99 == 0.0
    assert abs(advice.loop_lag_p99 - 0.5) <= RELATIVE_ERROR * 0.5
    expected = (3 * advice.loop_lag_p99 + 0.005) / (1 - 0.01 - 1 / 3)
    assert advice.ttl == adv._round_up(expected) and 2.2 <= advice.ttl <= 2.5
    assert "5 x p99 hold" in advice.reasoning and "Hold time does not matter" in advice.reasoning
    assert f"{lock_name}:*" in [a.template for a in backend.advice()]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "spec",
    ["sqlite", "postgres", "postgres_lease", "redis", "redlock", "etcd", "zookeeper"],
    indirect=True,
)
async def test_ttl_from_real_round_trips(spec: BackendSpec, lock_name: str) -> None:
    """Each real server's renewal round trips feed the ttl advice (the servers just started:
    the suite's defaults)."""
    async with spec.connect() as backend:
        backend.collect_advice()
        async with backend.lock(lock_name, ttl=0.2):
            for _ in range(25):
                with anyio.fail_after(10):
                    await next_renewal_round(backend)
        advice = backend.advise(lock_name)
    assert advice.renewal_samples >= 25 and advice.samples == 1
    assert advice.max_hold is None and advice.ttl is not None
    assert 0 < advice.round_trip_p99 < 1.0
    raw = adv.advised_ttl(advice.round_trip_p99, advice.loop_lag_p99, 0.01, 0.005, 1 / 3)
    assert advice.ttl == adv._round_up(raw) and advice.ttl >= adv.MIN_TTL


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_a_warning_once_per_template(
    spec: BackendSpec, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    caplog.set_level(logging.WARNING, logger="asynclock.advice")
    async with spec.connect(clock=clock) as backend:
        backend.collect_advice()
        # A renewal woken 2.5 s late for a ttl of 9 s: more than a third of its window
        async with backend.lock("slow:1", ttl=9.0):
            for _ in range(2):
                clock.advance(5.5)
                with anyio.fail_after(10):
                    await next_renewal_round(backend)
        for name in ("report:1", "report:2", "mail:1"):  # 85 % of max_hold: close
            async with backend.lock(name, ttl=60.0, max_hold=1.0):
                clock.advance(0.85)
        async with backend.lock("report:3", ttl=60.0, max_hold=1.0):
            clock.advance(0.5)  # not close
    warned = [r.getMessage() for r in caplog.records if r.name == "asynclock.advice"]
    assert len(warned) == 3, warned
    assert warned[0].startswith("locks 'slow:*': a renewal round took 2.5s")
    assert warned[1].startswith("locks 'report:*': a hold of 'report:1' lasted 0.85s, 85%")
    assert warned[2].startswith("locks 'mail:*'")


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_templates_are_capped_then_counted_as_other(spec: BackendSpec) -> None:
    async with spec.connect() as backend:
        backend.collect_advice(max_templates=50)
        for i in range(10_000):
            async with backend.lock(f"t{i}:x", ttl=5.0):
                pass
        collector = backend._advice
        assert collector is not None
        assert len(collector.templates) == 51  # the cap, and "(other)"
        assert collector.memory_bytes() == SKETCH_BYTES * 53
        assert collector.held == {}
        other = backend.advise("t9999:x")
        assert other.template == "(other)" and other.samples == 10_000 - 50
        assert backend.advise("t3:x").samples == 1


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_advice_and_otel_observe_one_backend_together(spec: BackendSpec) -> None:
    otel = pytest.importorskip("asynclock.otel")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    async with spec.connect() as backend:
        backend.collect_advice()
        assert otel.instrument(backend, meter_provider=MeterProvider(metric_readers=[reader]))
        async with backend.lock("a:1", ttl=5.0):
            pass
        otel.uninstrument(backend)  # advice goes on
        async with backend.lock("a:2", ttl=5.0):
            pass
        assert backend.advise("a:*").samples == 2
        backend.stop_advice()
        with pytest.raises(RuntimeError, match="collect_advice"):
            backend.advise("a:1")
    data = reader.get_metrics_data()
    assert data is not None
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert "asynclock.lease.duration" in names


def test_bad_arguments_say_what_is_allowed() -> None:
    backend = asynclock.connect("memory://")
    with pytest.raises(ValueError, match="max_templates must be an int from 1"):
        backend.collect_advice(max_templates=0)
    with pytest.raises(TypeError, match="name_template must be a function"):
        backend.collect_advice(name_template="x:*")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"call backend\.collect_advice"):
        backend.advise("x")
    for bad in ("10.0.0.1:80", "example.com:80", "nohost", "unix:"):
        with pytest.raises(ValueError):
            parse_address(bad)
    assert parse_address("localhost:0") == ("tcp", "localhost", 0)
    assert parse_address("[::1]:9") == ("tcp", "::1", 9)
    assert parse_address("/tmp/x.sock") == ("unix", "/tmp/x.sock", 0)


# -- serve_stats and the CLI, against a real second process ------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["sqlite"], indirect=True)
async def test_stats_and_advise_from_another_process(spec: BackendSpec, tmp_path: Path) -> None:
    sock = f"unix:{tmp_path / 'stats.sock'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.support.advice_process", spec.url, sock, "120"]
    async with await anyio.open_process(command, env=env) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        with anyio.fail_after(60):
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive()
        ready = json.loads(line)
        assert ready["address"] == sock
        assert ready["advice"]["samples"] == 120

        code, out, err = await cli("stats", "--from", sock, "--json")
        assert code == 0, err
        seen = json.loads(out)
        assert seen["pid"] == proc.pid and seen["stats"]["acquired"] == 121
        assert seen["backend"].startswith("sqlite:")
        templates = {a["template"]: a for a in seen["advice"]}
        assert templates["job:*"]["samples"] == 120 and templates["slow:*"]["samples"] == 1

        code, out, err = await cli("advise", "job:7", "--from", sock, "--json")
        assert code == 0, err
        advice = json.loads(out)
        assert advice["template"] == "job:*" and advice["enough"] is True
        assert advice["max_hold"] == ready["advice"]["max_hold"]
        assert advice["renewal_samples"] >= 25 and advice["ttl"] >= 1.0

        code, out, err = await cli("advise", "slow:1", "--from", sock)
        assert code == 1, err  # one hold: not enough samples
        assert "not enough samples: 1 of 100 holds of 'slow:*'" in " ".join(out.split())

        code, out, err = await cli("stats", "--from", sock, "--no-color")
        assert code == 0, err
        assert "job:*" in out and "acquired" in out

        code, out, err = await cli("advise", "", "--from", sock)
        assert code == 2 and "NAME" in err
        await proc.stdin.aclose()
        with anyio.fail_after(30):
            assert await proc.wait() == 0
    assert not (tmp_path / "stats.sock").exists()  # removed when serving ended

    code, out, err = await cli("stats", "--from", sock)
    assert code == 3 and "nothing answered at" in err
    code, out, err = await cli("stats", "--from", "10.1.2.3:80")
    assert code == 2 and "only loopback" in err


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_serve_stats_on_a_loopback_port(spec: BackendSpec) -> None:
    async with spec.connect() as backend, asynclock.serve_stats(backend, "127.0.0.1:0") as where:
        assert where.startswith("127.0.0.1:") and not where.endswith(":0")
        status, body = await anyio.to_thread.run_sync(fetch, where, "/")
        assert status == 200 and body["advice_collected"] is False and body["advice"] is None
        status, body = await anyio.to_thread.run_sync(fetch, where, "/advise?name=x")
        assert status == 409 and "collect_advice" in body["error"]
        status, body = await anyio.to_thread.run_sync(fetch, where, "/nope")
        assert status == 404
        code, _, err = await cli("advise", "x:1", "--from", where)
        assert code == 1 and "collect_advice" in err


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_a_socket_left_by_a_dead_process_is_replaced(
    spec: BackendSpec, tmp_path: Path
) -> None:
    import socket

    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays; nobody listens on it
    async with spec.connect() as backend, asynclock.serve_stats(backend, str(path)) as where:
        status, body = await anyio.to_thread.run_sync(fetch, where, "/")
        assert status == 200 and body["pid"] == os.getpid()
        # A live endpoint is not taken over.
        with pytest.raises(OSError, match="in use"):
            async with asynclock.serve_stats(backend, str(path)):
                pass
    assert not path.exists()


@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["memory"], indirect=True)
async def test_a_locked_function_counts_under_its_own_template(spec: BackendSpec) -> None:
    async with spec.connect() as backend:
        backend.collect_advice()

        @backend.locked_function("report:{day}/{kind}", ttl=5.0)
        async def report(day: int, kind: str) -> None:
            pass

        for day in range(3):
            await report(day, "daily")
        async with backend.lock("report:9/daily", ttl=5.0):  # a plain lock: the default
            pass
        assert backend.advise("report:{day}/{kind}").samples == 3
        assert backend.advise("report:9/daily").template == "report:*"
        assert backend.advise("report:*").samples == 1
