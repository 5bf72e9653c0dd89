"""OpenTelemetry metrics and spans for asynclock backends (``pip install "asynclock[otel]"``).

Only ``opentelemetry-api`` is needed at run time. ``instrument(backend)`` observes one
backend, through the providers configured when it is called; with no SDK configured it
installs nothing, and the hold path costs what it costs uninstrumented. Fence
rejections (which know no backend) are counted process-wide once any backend is
instrumented, or after :func:`instrument_fences`. Metric names, units and attributes are
documented in ``docs/operations.md`` ("OpenTelemetry").

A lock name is never an attribute as it is (unbounded cardinality): a lock made by
``locked_function`` reports its template (``"invoice:{invoice_id}"``); any other lock
reports ``name_template(name)``, by default :func:`default_name_template` (the text before
the first ``:`` followed by ``:*``, or ``*`` for a name without one).
"""

from __future__ import annotations

import contextlib
import logging
import re
import weakref
from collections.abc import Callable
from contextvars import Token
from typing import TYPE_CHECKING, Any

from ._core import observer as _seam
from ._core.advice import default_name_template
from ._core.backend import Backend
from ._core.exceptions import AcquireTimeout, LockHeld
from ._core.lease import Lease

try:
    from opentelemetry import context as _context
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.metrics import Observation
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'asynclock.otel needs the OpenTelemetry API: pip install "asynclock[otel]"'
    ) from exc

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = (
    "ATTR_BACKEND",
    "ATTR_ERROR_TYPE",
    "ATTR_FENCE",
    "ATTR_NAME_TEMPLATE",
    "ATTR_OWNER_LABEL",
    "ATTR_REASON",
    "ATTR_RESULT",
    "ATTR_TOKEN",
    "SECONDS_BUCKETS",
    "annotate_current_span",
    "default_name_template",
    "instrument",
    "instrument_fences",
    "uninstrument",
)

_SCOPE = "asynclock"
logger = logging.getLogger("asynclock")

#: Histogram bucket advice (seconds): 1 ms to 5 min, for waits and holds alike.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

ATTR_BACKEND = "asynclock.backend"
ATTR_NAME_TEMPLATE = "asynclock.lock.name_template"
#: This process's owner label (``connect(url, owner_label=...)``, default ``host:pid``):
#: on spans only, never on metrics (one value per process would multiply every series).
ATTR_OWNER_LABEL = "asynclock.owner_label"
ATTR_RESULT = "asynclock.result"
ATTR_REASON = "asynclock.lease.lost_reason"
ATTR_TOKEN = "asynclock.lease.token"
ATTR_FENCE = "asynclock.fence"
ATTR_ERROR_TYPE = "error.type"

NameTemplateFunction = Callable[[str], str]

#: How many distinct attribute sets an observer keeps for reuse.
_CACHED = 1024


def _reason_class(reason: str) -> str:
    """A loss reason without its details (as ``backend.stats().loss_reasons`` keys it)."""
    return re.split(r"[:;(]", reason, maxsplit=1)[0].strip() or "lost"


def _result_of(error: BaseException) -> tuple[str, str]:
    """(result, error.type) of an acquisition that raised ``error``."""
    if isinstance(error, AcquireTimeout):
        return "timeout", ""
    if isinstance(error, LockHeld):
        return "busy", ""
    if isinstance(error, Exception):
        return "error", type(error).__qualname__
    return "error", "cancelled"  # a cancellation (or KeyboardInterrupt...)


class _Instruments:
    """One meter's instruments, shared by the backends instrumented with one meter
    provider (an instrument is made once per meter: a second one of the same name is
    refused by the SDK, or silently merged)."""

    def __init__(self, provider: MeterProvider | None) -> None:
        from ._version import __version__

        #: The observers whose held leases ``asynclock.lease.active`` reports.
        self.observers: weakref.WeakSet[_OtelObserver] = weakref.WeakSet()
        meter = _metrics.get_meter(_SCOPE, __version__, meter_provider=provider)
        self.wait_time = meter.create_histogram(
            "asynclock.lease.wait_time",
            unit="s",
            description="Time an acquisition took, from the request to its result.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "asynclock.lease.duration",
            unit="s",
            description="Time a lease was held, from its request to its release.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        # Observed when collected, not added to per hold: two SDK calls fewer per hold
        # (each costs about as much as the rest of an uncontended hold on memory://).
        self.active = meter.create_observable_up_down_counter(
            "asynclock.lease.active",
            callbacks=[self._observe_active],
            unit="{lease}",
            description="Leases held now (granted, neither released nor lost).",
        )
        self.lost = meter.create_counter(
            "asynclock.lease.lost",
            unit="{lease}",
            description="Leases lost while held, by reason.",
        )
        self.renewals = meter.create_counter(
            "asynclock.lease.renewals",
            unit="{renewal}",
            description="Lease renewals, by result (ok, failed).",
        )
        self.late = meter.create_counter(
            "asynclock.lease.renewals_late",
            unit="{renewal}",
            description=(
                "Renewals sent with less than half of the lease's margin left: the renewer "
                "or the event loop falling behind, before any lease is lost."
            ),
        )
        self.stale = meter.create_counter(
            "asynclock.fence.rejections",
            unit="{write}",
            description="Writes a fence rejected for a stale token (StaleToken raised).",
        )

    def _observe_active(self, options: CallbackOptions) -> list[Observation]:
        totals: dict[tuple[str, str], int] = {}
        for observer in list(self.observers):
            for key, count in observer.active.items():
                totals[key] = totals.get(key, 0) + count
        return [
            Observation(count, {ATTR_BACKEND: backend, ATTR_NAME_TEMPLATE: template})
            for (backend, template), count in totals.items()
        ]


#: The instruments of each meter provider passed to instrument() or instrument_fences().
_INSTRUMENTS: weakref.WeakKeyDictionary[MeterProvider, _Instruments] = weakref.WeakKeyDictionary()
_global_instruments: _Instruments | None = None


def _instruments(provider: MeterProvider | None) -> _Instruments:
    """The instruments of ``provider`` (None: the global one), made once."""
    global _global_instruments
    if provider is None:
        if _global_instruments is None:
            _global_instruments = _Instruments(None)
        return _global_instruments
    instruments = _INSTRUMENTS.get(provider)
    if instruments is None:
        instruments = _INSTRUMENTS[provider] = _Instruments(provider)
    return instruments


class _Acquiring:
    __slots__ = ("attrs", "span", "token")

    def __init__(
        self, attrs: dict[str, str], span: Any, token: Token[_context.Context] | None
    ) -> None:
        self.attrs, self.span, self.token = attrs, span, token


class _OtelObserver(_seam.Observer):
    """The OpenTelemetry implementation of the core's observer seam."""

    def __init__(
        self,
        backend: str,
        instruments: _Instruments,
        tracer: Any | None,
        name_template: NameTemplateFunction,
        owner_label: str,
    ) -> None:
        self.backend = backend
        self.owner_label = owner_label
        self.m = instruments
        self.tracer = tracer
        self.name_template = name_template
        self.base = {ATTR_BACKEND: backend}
        #: owner -> [attributes, still counted as active]
        self.held: dict[str, tuple[dict[str, str], list[bool]]] = {}
        #: (backend, name template) -> leases held now (zeros kept: reported as 0).
        self.active: dict[tuple[str, str], int] = {}
        # Attribute sets made once and reused (the SDK hashes what it is given on every
        # record; a fresh dict per hold costs more than the lookup). Bounded: a template
        # function returning too many values stops being cached, not remembered.
        self._attrs: dict[str, dict[str, str]] = {}
        self._points: dict[tuple[str, str, str], dict[str, str]] = {}
        #: template -> a span's attributes: the metric ones and the owner label.
        self._span_attrs: dict[str, dict[str, str]] = {}

    def acquire_started(self, name: str, template: str | None) -> object:
        if template is None:
            template = self.name_template(name)
        attrs = self._attributes(template)
        if self.tracer is None:  # no tracer provider configured: no span at all
            return _Acquiring(attrs, None, None)
        span_attrs = self._span_attrs.get(template)
        if span_attrs is None:
            span_attrs = {**attrs, ATTR_OWNER_LABEL: self.owner_label}
            if len(self._span_attrs) < _CACHED:
                self._span_attrs[template] = span_attrs
        span = self.tracer.start_span(
            f"acquire {template}", kind=_trace.SpanKind.INTERNAL, attributes=span_attrs
        )
        # Current while the driver works: its redis/asyncpg CLIENT spans are children.
        token = _context.attach(_trace.set_span_in_context(span))
        return _Acquiring(attrs, span, token)

    def acquire_finished(
        self, state: object, lease: Lease | None, waited: float, error: BaseException | None
    ) -> None:
        assert isinstance(state, _Acquiring)
        span, attrs = state.span, state.attrs
        if state.token is not None:
            # (A foreign change of the context in between must not make an acquire raise.)
            with contextlib.suppress(Exception):
                _context.detach(state.token)
        if lease is not None:
            result, error_type = "acquired", ""
            self._hold(lease, attrs)
            if span is not None:  # tracing: the caller's span (a request's, a task's) too
                _annotate(_trace.get_current_span(), lease.token, attrs[ATTR_NAME_TEMPLATE])
        else:
            assert error is not None
            result, error_type = _result_of(error)
        key = (attrs[ATTR_NAME_TEMPLATE], result, error_type)
        point = self._points.get(key)
        if point is None:
            point = {**attrs, ATTR_RESULT: result}
            if error_type:
                point[ATTR_ERROR_TYPE] = error_type
            if len(self._points) < _CACHED:
                self._points[key] = point
        self.m.wait_time.record(waited, point)
        if span is not None:
            span.set_attribute(ATTR_RESULT, result)
            if lease is not None:
                span.set_attribute(ATTR_TOKEN, lease.token)
            elif error_type:
                span.set_attribute(ATTR_ERROR_TYPE, error_type)
                span.set_status(_trace.Status(_trace.StatusCode.ERROR, error_type))
            span.end()

    def adopted(self, lease: Lease) -> None:
        # Granted on another thread (no wait time, no span): held from here on.
        attrs = self._attributes(self.name_template(lease.name))
        self._hold(lease, attrs)

    def released(self, lease: Lease, held: float) -> None:
        entry = self.held.pop(lease.owner, None)
        if entry is None:
            return  # released before (a retried release), or granted before instrument()
        attrs, active = entry
        if active[0]:
            self._inactive(attrs)
        self.m.duration.record(held, attrs)

    def lost(self, lease: Lease, reason: str) -> None:
        entry = self.held.get(lease.owner)
        attrs = entry[0] if entry is not None else self.base
        if entry is not None and entry[1][0]:
            entry[1][0] = False
            self._inactive(attrs)
        self.m.lost.add(1, {**attrs, ATTR_REASON: _reason_class(reason)})

    def _attributes(self, template: str) -> dict[str, str]:
        attrs = self._attrs.get(template)
        if attrs is None:
            attrs = {ATTR_BACKEND: self.backend, ATTR_NAME_TEMPLATE: template}
            if len(self._attrs) < _CACHED:
                self._attrs[template] = attrs
        return attrs

    def _hold(self, lease: Lease, attrs: dict[str, str]) -> None:
        self.held[lease.owner] = (attrs, [True])
        key = (self.backend, attrs[ATTR_NAME_TEMPLATE])
        self.active[key] = self.active.get(key, 0) + 1

    def _inactive(self, attrs: dict[str, str]) -> None:
        key = (self.backend, attrs[ATTR_NAME_TEMPLATE])
        self.active[key] -= 1

    def renewal_round(self, renewed: int, failed: int) -> None:
        if renewed:
            self.m.renewals.add(renewed, {**self.base, ATTR_RESULT: "ok"})
        if failed:
            self.m.renewals.add(failed, {**self.base, ATTR_RESULT: "failed"})

    def renewal_behind(self, leases: int, left: float) -> None:
        self.m.late.add(leases, self.base)


def _annotate(span: Any, token: int, template: str) -> bool:
    if not span.is_recording():
        return False
    span.set_attribute(ATTR_TOKEN, token)
    span.set_attribute(ATTR_NAME_TEMPLATE, template)
    return True


def annotate_current_span(lease: Lease, template: str | None = None) -> bool:
    """Put ``lease``'s fencing token (``asynclock.lease.token``) and its name template
    (``asynclock.lock.name_template``: ``template``, else :func:`default_name_template`
    of its name) on the span current in this thread or task, if one is recording: the
    span of the Celery task, the request or the job that runs under the lease. The Celery
    integration calls it for every locked run; an instrumented backend (with a tracer)
    does it for every acquire. Returns whether a span took them."""
    if template is None:
        template = default_name_template(lease.name)
    return _annotate(_trace.get_current_span(), lease.token, template)


_fence_counter: Any = None


def _count_stale(kind: str) -> None:
    _fence_counter.add(1, {ATTR_FENCE: kind})


def instrument_fences(*, meter_provider: MeterProvider | None = None) -> None:
    """Count fence rejections (``asynclock.fence.rejections``) on ``meter_provider``'s
    meter (default: the global one). Process-wide: fences know no backend; a later call
    replaces the provider."""
    global _fence_counter
    _fence_counter = _instruments(meter_provider).stale
    _seam.on_stale_token = _count_stale


def instrument(
    backend: Backend,
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    name_template: NameTemplateFunction = default_name_template,
) -> bool:
    """Report ``backend``'s acquisitions, holds, losses and renewals to OpenTelemetry.

    ``meter_provider``, ``tracer_provider``: default the global ones (no-ops until an SDK
    sets them). ``name_template(name)``: the ``asynclock.lock.name_template`` attribute of
    a lock not made from a template; return few distinct values (it is a metric
    attribute). Call it before or after the backend opens; leases already held are not
    counted. Also counts fence rejections (:func:`instrument_fences`) if nothing does yet.
    Calling it again replaces the previous instrumentation of ``backend``.

    The providers are looked up now, once: set up the SDK first. With neither provider
    passed and no SDK configured globally, nothing is installed (the hold path costs what
    it costs uninstrumented) and it returns False; else True. Without a tracer provider
    (passed or global), no spans are started at all.
    """
    if not isinstance(backend, Backend):
        raise TypeError(
            f"instrument() takes an asynclock Backend (from asynclock.connect), "
            f"not {type(backend).__name__}"
        )
    if not callable(name_template):
        raise TypeError(
            "name_template must be a function from a lock name to a low-cardinality "
            f"template (str -> str), not {type(name_template).__name__}"
        )
    from ._version import __version__

    _detach(backend)  # replaces any earlier instrumentation
    if _seam.on_stale_token is None:
        instrument_fences(meter_provider=meter_provider)
    metering = meter_provider is not None or _configured(_metrics.get_meter_provider())
    tracing = tracer_provider is not None or _configured(_trace.get_tracer_provider())
    if not (metering or tracing):
        # No SDK: every instrument and span would be a no-op; the hold path stays the
        # plain one (zero cost). Providers are looked up here, once: set up the SDK first.
        logger.debug(
            "asynclock.otel: no OpenTelemetry SDK configured; %s not instrumented", backend
        )
        return False
    tracer = (
        _trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider) if tracing else None
    )
    scheme = backend.driver.display.split("://", 1)[0] or "unknown"
    instruments = _instruments(meter_provider)
    observer = _OtelObserver(scheme, instruments, tracer, name_template, backend.owner_label)
    instruments.observers.add(observer)
    backend.add_observer(observer)  # beside backend.collect_advice()'s, if any
    return True


def _configured(provider: object) -> bool:
    """False for the API's own providers (the global default proxies and the no-ops)."""
    return (
        not isinstance(
            provider,
            _trace.ProxyTracerProvider | _trace.NoOpTracerProvider | _metrics.NoOpMeterProvider,
        )
        and type(provider).__name__ != "_ProxyMeterProvider"
    )


def uninstrument(backend: Backend) -> None:
    """Stop reporting ``backend`` (its hold path is the uninstrumented one again)."""
    _detach(backend)


def _detach(backend: Backend) -> None:
    for old in backend.observers():
        if isinstance(old, _OtelObserver):
            old.m.observers.discard(old)  # its leases leave asynclock.lease.active
            backend.remove_observer(old)
