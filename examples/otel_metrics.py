"""Locks reported to OpenTelemetry: the acquire span and the lease metrics of a few holds.

Needs the SDK for the in-memory reader this example prints from (in production, an
exporter: OTLP, or Prometheus as docs/operations.md shows); asynclock itself needs only
the API (``pip install "asynclock[otel]"``).

Run: uv run python examples/otel_metrics.py
"""

from __future__ import annotations

import anyio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import asynclock
import asynclock.otel


async def try_once(backend: asynclock.Backend) -> None:
    try:
        async with backend.lock("invoice:42", ttl=5.0, blocking=False):
            pass
    except asynclock.LockHeld:
        print("second holder refused (busy)")


async def main() -> None:
    reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    async with asynclock.connect("memory://") as backend:
        # Set up the SDK first: instrument() looks the providers up once (passed here; the
        # global ones by default) and installs nothing when there is no SDK.
        asynclock.otel.instrument(
            backend, meter_provider=MeterProvider(metric_readers=[reader]), tracer_provider=tracers
        )
        for invoice in (41, 42):
            async with backend.lock(f"invoice:{invoice}", ttl=5.0) as lease:
                print(f"holding {lease.name!r} with token {lease.token}")
        async with backend.lock("invoice:42", ttl=5.0), anyio.create_task_group() as tg:
            tg.start_soon(try_once, backend)  # another task: busy

    for span in exporter.get_finished_spans():
        attrs = dict(span.attributes or {})
        print(f"span {span.name!r}: result={attrs['asynclock.result']}")
    data = reader.get_metrics_data()
    assert data is not None
    for metric in data.resource_metrics[0].scope_metrics[0].metrics:
        for point in metric.data.data_points:
            attrs = dict(point.attributes or {})
            value = getattr(point, "value", None)
            shown = value if value is not None else f"count={getattr(point, 'count', '?')}"
            labels = ",".join(f"{k}={v}" for k, v in sorted(attrs.items()))
            print(f"{metric.name}{{{labels}}} {shown}")


if __name__ == "__main__":
    anyio.run(main)
