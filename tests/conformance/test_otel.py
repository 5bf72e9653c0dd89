"""asynclock.otel: what a backend did, read back through the OpenTelemetry SDK's in-memory
metric reader and span exporter, on memory://, sqlite:// and a real Redis. The counts
must match what happened: acquisitions by result, holds, active leases, a forced loss,
renewals, a fence rejection; and with no SDK configured nothing breaks."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import asynclock
import asynclock.otel
from asynclock._core import observer as seam
from asynclock.fence import RedisFence, SQLFence
from asynclock.testing import force_loss, next_renewal_round
from tests.conftest import BACKENDS
from tests.support.redis_servers import RedisServer
from tests.support.spec import BackendSpec

pytestmark = pytest.mark.anyio

Key = tuple[str, frozenset[tuple[str, Any]]]


class Telemetry:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))

    def points(self) -> dict[Key, Any]:
        """(metric name, attributes) -> the point (a sum's value; a histogram's point)."""
        out: dict[Key, Any] = {}
        data = self.reader.get_metrics_data()
        if data is None:
            return out
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        key = (metric.name, frozenset((point.attributes or {}).items()))
                        out[key] = getattr(point, "value", point)
        return out

    def total(self, name: str, **where: Any) -> float:
        """A counter's sum (a histogram's count) over the points whose attributes match."""
        total = 0.0
        for (metric, attrs), point in self.points().items():
            if metric == name and set(where.items()) <= set(attrs):
                total += point if isinstance(point, int | float) else point.count
        return total

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    hook = seam.on_stale_token
    yield t
    seam.on_stale_token = hook


@pytest.fixture(params=BACKENDS)
def otel_spec(request: pytest.FixtureRequest) -> BackendSpec:
    spec: BackendSpec = request.getfixturevalue(f"spec_{request.param}")
    return spec


async def test_counts_match_what_happened(
    otel_spec: BackendSpec, telemetry: Telemetry, lock_name: str
) -> None:
    name = f"otel:{lock_name}"
    async with otel_spec.connect() as backend:
        asynclock.otel.instrument(
            backend, meter_provider=telemetry.meters, tracer_provider=telemetry.tracers
        )
        label = backend.owner_label
        tokens = []
        with anyio.fail_after(10):
            for _ in range(3):  # acquired, held, released
                async with backend.lock(name, ttl=5) as lease:
                    tokens.append(lease.token)
            held, done = anyio.Event(), anyio.Event()

            async def holder() -> None:
                async with backend.lock(name, ttl=5):
                    held.set()
                    await done.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await held.wait()
                with pytest.raises(asynclock.LockHeld):
                    async with backend.lock(name, ttl=5, blocking=False):
                        pass
                with pytest.raises(asynclock.AcquireTimeout):
                    async with backend.lock(name, ttl=5, timeout=0.05):
                        pass
                assert telemetry.total("asynclock.lease.active") == 1
                done.set()
            # A loss: the body is cancelled, the block raises LeaseLost.
            with pytest.raises(asynclock.LeaseLost):
                async with backend.lock(name, ttl=5) as lease:
                    tokens.append(lease.token)
                    force_loss(lease, "test: forced")
                    await anyio.sleep_forever()
            # A renewal round (ttl 0.3 s: renewed every 0.1 s).
            async with backend.lock(name, ttl=0.3) as lease:
                tokens.append(lease.token)
                await next_renewal_round(backend)

    t = telemetry
    wait = "asynclock.lease.wait_time"
    assert t.total(wait, **{"asynclock.result": "acquired"}) == 6
    assert t.total(wait, **{"asynclock.result": "busy"}) == 1
    assert t.total(wait, **{"asynclock.result": "timeout"}) == 1
    assert t.total(wait, **{"asynclock.result": "error"}) == 0
    assert t.total(wait, **{"asynclock.backend": otel_spec.url.split("://")[0]}) == 8
    assert t.total(wait, **{"asynclock.lock.name_template": "otel:*"}) == 8
    assert t.total("asynclock.lease.duration") == 6
    assert t.total("asynclock.lease.active") == 0
    assert t.total("asynclock.lease.lost") == 1
    assert t.total("asynclock.lease.lost", **{"asynclock.lease.lost_reason": "test"}) == 1
    assert t.total("asynclock.lease.renewals", **{"asynclock.result": "ok"}) >= 1
    assert t.total("asynclock.lease.renewals", **{"asynclock.result": "failed"}) == 0
    # No raw name anywhere (bounded cardinality).
    assert not any(name in str(attrs) for _, attrs in t.points())

    spans = t.spans()
    assert len(spans) == 8
    assert {s.kind for s in spans} == {SpanKind.INTERNAL}
    assert {s.name for s in spans} == {"acquire otel:*"}
    attributes = [dict(s.attributes or {}) for s in spans]
    granted = [
        a["asynclock.lease.token"] for a in attributes if a["asynclock.result"] == "acquired"
    ]
    assert len(granted) == 6 and set(tokens) <= set(granted)
    assert not any(name in str(s.attributes) for s in spans)
    # Which process: the owner label on every span, never on a metric (one per process).
    assert {a["asynclock.owner_label"] for a in attributes} == {label}
    assert t.points() and not any("asynclock.owner_label" in dict(a) for _, a in t.points())


async def test_renewal_refused_is_a_loss_and_a_failed_renewal(
    otel_spec: BackendSpec, telemetry: Telemetry, lock_name: str
) -> None:
    async with otel_spec.connect() as backend:
        asynclock.otel.instrument(backend, meter_provider=telemetry.meters)
        with anyio.fail_after(10), pytest.raises(asynclock.LeaseLost):
            async with backend.lock(lock_name, ttl=0.6):
                await otel_spec.sabotage(backend, lock_name)
                await anyio.sleep_forever()  # the next renewal is refused
    assert telemetry.total("asynclock.lease.renewals", **{"asynclock.result": "failed"}) == 1
    assert telemetry.total("asynclock.lease.lost") == 1
    assert telemetry.total("asynclock.lease.active") == 0
    assert telemetry.total("asynclock.lease.duration") == 1
    assert telemetry.spans() == []  # no tracer provider: no spans started


async def test_locked_function_reports_its_template(telemetry: Telemetry) -> None:
    async with asynclock.connect("memory://") as backend:
        asynclock.otel.instrument(
            backend, meter_provider=telemetry.meters, tracer_provider=telemetry.tracers
        )

        @backend.locked_function("report:{customer}", ttl=5)
        async def report(customer: int) -> int:
            return customer

        with anyio.fail_after(5):
            assert await report(1) + await report(2) == 3
    points = telemetry.points()
    assert (
        telemetry.total(
            "asynclock.lease.wait_time", **{"asynclock.lock.name_template": "report:{customer}"}
        )
        == 2
    ), points
    assert {s.name for s in telemetry.spans()} == {"acquire report:{customer}"}


async def test_name_template_function(telemetry: Telemetry) -> None:
    async with asynclock.connect("memory://") as backend:
        asynclock.otel.instrument(
            backend, meter_provider=telemetry.meters, name_template=lambda n: n.split("/")[0]
        )
        with anyio.fail_after(5):
            async with backend.lock("tenant/42", ttl=5):
                pass
    assert (
        telemetry.total("asynclock.lease.duration", **{"asynclock.lock.name_template": "tenant"})
        == 1
    )


def test_default_name_template() -> None:
    assert asynclock.otel.default_name_template("invoice:42:line:3") == "invoice:*"
    assert asynclock.otel.default_name_template("nightly-report") == "*"


async def test_fence_rejection_counted(telemetry: Telemetry, tmp_path: Path) -> None:
    asynclock.otel.instrument_fences(meter_provider=telemetry.meters)
    conn, fence = sqlite3.connect(tmp_path / "r.db", isolation_level=None), SQLFence()
    fence.create_sqlite(conn)
    with fence.sqlite_transaction(conn, "k", 7):
        pass
    for stale in (5, 6):
        with pytest.raises(asynclock.StaleToken), fence.sqlite_transaction(conn, "k", stale):
            pass
    conn.close()
    assert telemetry.total("asynclock.fence.rejections", **{"asynclock.fence": "sql"}) == 2


async def test_without_an_sdk_nothing_breaks(tmp_path: Path) -> None:
    """The global providers are the API's no-ops here (no test sets them): instrument()
    leaves the hold path as it is; holds, losses and fences work as before."""
    hook = seam.on_stale_token
    try:
        async with asynclock.connect("memory://") as backend:
            assert asynclock.otel.instrument(backend) is False
            assert backend.observers() == ()
            asynclock.otel.instrument_fences()
            with anyio.fail_after(5):
                async with backend.lock("a:1", ttl=5):
                    pass
                with pytest.raises(asynclock.LeaseLost):
                    async with backend.lock("a:1", ttl=5) as lease:
                        force_loss(lease)
                        await anyio.sleep_forever()
            conn, fence = sqlite3.connect(tmp_path / "r.db", isolation_level=None), SQLFence()
            fence.create_sqlite(conn)
            with fence.sqlite_transaction(conn, "k", 7):
                pass
            with pytest.raises(asynclock.StaleToken), fence.sqlite_transaction(conn, "k", 6):
                pass
            conn.close()
            assert backend.stats().acquired == 2
    finally:
        seam.on_stale_token = hook


async def test_uninstrument_restores_the_plain_hold_path(telemetry: Telemetry) -> None:
    async with asynclock.connect("memory://") as backend:
        assert backend.observers() == () and backend._session.observer is None
        assert asynclock.otel.instrument(backend, meter_provider=telemetry.meters) is True
        assert len(backend.observers()) == 1
        asynclock.otel.uninstrument(backend)
        assert backend.observers() == () and backend._session.observer is None
        with anyio.fail_after(5):
            async with backend.lock("a:1", ttl=5):
                pass
    assert telemetry.total("asynclock.lease.wait_time") == 0


def test_bad_arguments_say_what_is_allowed() -> None:
    with pytest.raises(TypeError, match="asynclock Backend"):
        asynclock.otel.instrument("memory://")  # type: ignore[arg-type]
    backend = asynclock.connect("memory://")
    with pytest.raises(TypeError, match="str -> str"):
        asynclock.otel.instrument(backend, name_template="x:*")  # type: ignore[arg-type]


async def test_acquire_span_is_the_parent_of_driver_spans(telemetry: Telemetry) -> None:
    """What redis/asyncpg instrumentation does, done by a memory driver: a CLIENT span
    started inside the driver's acquire is a child of the acquire span."""
    from opentelemetry import trace

    from asynclock.backends.memory import MemoryDriver

    tracer = telemetry.tracers.get_tracer("driver")

    class TracedMemory(MemoryDriver):
        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            with tracer.start_as_current_span("EVALSHA", kind=trace.SpanKind.CLIENT):
                return await super().acquire(*args, **kwargs)

    async with asynclock.Backend(TracedMemory()) as backend:
        asynclock.otel.instrument(backend, tracer_provider=telemetry.tracers)
        with anyio.fail_after(5):
            async with backend.lock("a:1", ttl=5):
                assert not trace.get_current_span().get_span_context().is_valid  # detached
    client, acquire = sorted(telemetry.spans(), key=lambda s: s.name)
    assert (client.name, acquire.name) == ("EVALSHA", "acquire a:*")
    assert client.parent is not None and acquire.context is not None
    assert client.parent.span_id == acquire.context.span_id


async def test_redis_fence_rejection_counted(
    telemetry: Telemetry, redis_server: RedisServer, lock_name: str
) -> None:
    """A holder that lost its lock writes behind a Redis fence: rejected and counted."""
    asynclock.otel.instrument_fences(meter_provider=telemetry.meters)
    client = redis.asyncio.Redis.from_url(redis_server.url)
    fence, key = RedisFence(), f"data:{lock_name}"
    try:
        async with asynclock.connect(redis_server.url) as backend:
            asynclock.otel.instrument(backend, meter_provider=telemetry.meters)
            with anyio.fail_after(10):
                with pytest.raises(asynclock.LeaseLost):
                    async with backend.lock(lock_name, ttl=5) as old:
                        force_loss(old, "test: forced")
                        await anyio.sleep_forever()
                async with backend.lock(lock_name, ttl=5) as new:
                    await fence.set(client, key, "new", new.token)
                with pytest.raises(asynclock.StaleToken):
                    await fence.set(client, key, "late", old.token)
    finally:
        await client.aclose()
    assert telemetry.total("asynclock.fence.rejections", **{"asynclock.fence": "redis"}) == 1
    assert telemetry.total("asynclock.lease.lost", **{"asynclock.backend": "redis"}) == 1


def test_leases_a_body_thread_takes_itself_are_reported(
    telemetry: Telemetry, spec_redis: BackendSpec, lock_name: str
) -> None:
    """On one Redis server a synchronous body (asynclock.from_thread, Celery's LockedTask)
    acquires and releases with the driver's blocking calls; the loop adopts and settles
    them, and that is what is reported: held (active) and for how long (no wait, no span)."""
    from asynclock.from_thread import LoopThread, hold

    async def settled(backend: asynclock.Backend) -> asynclock.BackendStats:
        return backend.stats()  # on the loop: runs what the body's thread left for it first

    with LoopThread() as thread:
        backend = thread.backend(spec_redis.url)
        assert asynclock.otel.instrument(backend, meter_provider=telemetry.meters)
        for _ in range(2):
            with hold(thread, spec_redis.url, f"job:{lock_name}", ttl=5.0):
                pass
        stats = thread.run(settled(backend))
    assert (stats.acquired, stats.released) == (2, 2)
    assert (
        telemetry.total("asynclock.lease.duration", **{"asynclock.lock.name_template": "job:*"})
        == 2
    )
    assert telemetry.total("asynclock.lease.active") == 0


def test_only_the_api_is_needed() -> None:
    """asynclock.otel never imports the SDK: with it made unimportable, instrumenting and
    holding still work (the run-time dependency is opentelemetry-api alone)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["opentelemetry.sdk"] = None  # import opentelemetry.sdk... now fails
import anyio, asynclock, asynclock.otel

async def main():
    async with asynclock.connect("memory://") as backend:
        assert asynclock.otel.instrument(backend) is False
        async with backend.lock("a:1", ttl=5) as lease:
            print("token", lease.token)

anyio.run(main)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "token 1\n"


async def test_an_acquire_puts_the_token_on_the_callers_span(telemetry: Telemetry) -> None:
    """The span current where a lease is taken (a request's, a task's) gets its token and
    name template; annotate_current_span() does the same for a lease taken elsewhere and
    says False when no span records."""
    tracer = telemetry.tracers.get_tracer("test")
    async with asynclock.connect("memory://") as backend:
        asynclock.otel.instrument(backend, tracer_provider=telemetry.tracers)
        with tracer.start_as_current_span("request"):
            async with backend.lock("invoice:42", ttl=5) as lease:
                token = lease.token
        assert not asynclock.otel.annotate_current_span(lease)  # no span current here
        with tracer.start_as_current_span("job"):
            assert asynclock.otel.annotate_current_span(lease, "invoice:{id}")
    spans = {s.name: dict(s.attributes or {}) for s in telemetry.spans()}
    assert spans["request"] == {
        "asynclock.lease.token": token,
        "asynclock.lock.name_template": "invoice:*",
    }
    assert spans["job"]["asynclock.lock.name_template"] == "invoice:{id}"
    assert "invoice:42" not in str(spans)
