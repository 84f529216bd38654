"""The OpenTelemetry implementation of :mod:`disagg_router.router.observability.tracing` (needs the
``tracing`` extra).

Imported only by :func:`disagg_router.router.runtime.make_tracer` when ``tracing.enabled`` is true.
Spans are exported in batches over OTLP/HTTP to ``tracing.endpoint``; context travels as W3C
``traceparent``/``tracestate`` headers (in from the client, out to both legs).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from disagg_router.router.config import TracingConfig
from disagg_router.router.observability.tracing import Span

_PROPAGATOR = TraceContextTextMapPropagator()


class OtelSpan:
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span

    def child(self, name: str, attributes: Mapping[str, str] | None = None) -> Span:
        ctx = trace.set_span_in_context(self._span)
        return OtelSpan(
            self._tracer, self._tracer.start_span(name, context=ctx, attributes=attributes)
        )

    def set(self, key: str, value: str) -> None:
        self._span.set_attribute(key, value)

    def event(self, name: str) -> None:
        self._span.add_event(name)

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier

    def end(self, error: str | None = None) -> None:
        if error is not None:
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self._span.end()


class OtelTracer:
    """One tracer provider per runtime (not the process-global one)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({"service.name": config.service_name})
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))
        self._provider = TracerProvider(resource=resource, sampler=sampler)
        exporter = exporter or OTLPSpanExporter(
            endpoint=config.endpoint, timeout=config.export_timeout
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("disagg-router")

    def request_span(self, name: str, headers: Mapping[str, str]) -> Span:
        parent = _PROPAGATOR.extract(dict(headers))
        return OtelSpan(self._tracer, self._tracer.start_span(name, context=parent))

    def shutdown(self) -> None:
        self._provider.shutdown()
