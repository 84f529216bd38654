"""``logging`` (the request log) and ``tracing`` (OpenTelemetry)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from disagg_router.router.config._base import Frozen


class LoggingConfig(Frozen):
    """``format``: text or json (one object per line: request id, model, P, D, outcome, stage
    timings on the request summary lines). ``requests``: log one summary line per request."""

    format: Literal["text", "json"] = "text"
    requests: bool = True


class TracingConfig(Frozen):
    """OpenTelemetry tracing (needs the ``tracing`` extra); off by default and then free.
    ``endpoint``: OTLP/HTTP traces URL. W3C ``traceparent`` is propagated to both legs."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = Field(default="disagg-router", min_length=1)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    export_timeout: float = Field(default=10.0, gt=0)
