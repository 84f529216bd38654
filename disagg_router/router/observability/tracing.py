"""Optional OpenTelemetry tracing behind one small interface; a no-op when tracing is off.

Who calls it: the runtime builds one :class:`Tracer` from ``tracing`` in the config
(:func:`disagg_router.router.runtime.make_tracer`: :class:`NoTracer`, or
:mod:`disagg_router.router.observability.otel`'s); the request guard
(:mod:`disagg_router.router.http.guard`) opens a request span (continuing a client's W3C
``traceparent``), the dispatch a span per leg and one up to the first token, and each leg sends its
span's ``traceparent`` to vLLM. With tracing off (the default) every call is a constant no-op and
the ``opentelemetry`` packages are never imported; they come with the ``tracing`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Span(Protocol):
    """One span; children, attributes, events, its propagation headers, its end."""

    def child(self, name: str, attributes: Mapping[str, str] | None = None) -> Span: ...

    def set(self, key: str, value: str) -> None: ...

    def event(self, name: str) -> None: ...

    def headers(self) -> dict[str, str]: ...

    def end(self, error: str | None = None) -> None: ...


class _NoSpan:
    """The span of a disabled tracer: does nothing, costs nothing."""

    def child(self, name: str, attributes: Mapping[str, str] | None = None) -> Span:
        return self

    def set(self, key: str, value: str) -> None:
        return None

    def event(self, name: str) -> None:
        return None

    def headers(self) -> dict[str, str]:
        return {}

    def end(self, error: str | None = None) -> None:
        return None


NO_SPAN: Span = _NoSpan()


class Tracer(Protocol):
    def request_span(self, name: str, headers: Mapping[str, str]) -> Span: ...

    def shutdown(self) -> None: ...


class NoTracer:
    """Tracing off."""

    def request_span(self, name: str, headers: Mapping[str, str]) -> Span:
        return NO_SPAN

    def shutdown(self) -> None:
        return None


def span_attributes(**values: Any) -> dict[str, str]:
    """String attributes for a span (None values left out)."""
    return {k: str(v) for k, v in values.items() if v is not None}
