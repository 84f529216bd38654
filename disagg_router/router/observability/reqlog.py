"""Logging setup and the one summary line per client request.

Who calls it: ``disagg-router serve`` (:mod:`disagg_router.router.cli`, :func:`configure_logging`)
and the generation endpoints (:mod:`disagg_router.router.http.generate`, :func:`log_request` when a
generation request ends). With ``logging.format: json`` every log record is one JSON object per
line; the summary record carries the request id (and the client's own id when it sent a safe one),
model, P, D, outcome, HTTP status and stage timings as fields.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from disagg_router.router.config import LoggingConfig
from disagg_router.router.request import RequestContext

log = logging.getLogger("disagg_router.router.requests")

_SUMMARY = "request_summary"  # attribute of a record that carries the summary fields


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the summary fields if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, _SUMMARY, {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def configure_logging(config: LoggingConfig, level: str) -> None:
    """Root logging for the server process: text or JSON lines on stderr at ``level``."""
    handler = logging.StreamHandler()
    if config.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Labelled(Protocol):
    """An instance as the log line names it."""

    @property
    def label(self) -> str: ...


class Served(Protocol):
    """What served a request, as its log line names it: a generation request's dispatch (its P,
    if any, and its D) or a pass-through request's exchange (its one instance, as P or D)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prefill(self) -> Labelled | None: ...

    @property
    def decode(self) -> Labelled | None: ...

    @property
    def timings(self) -> dict[str, float]: ...


def log_request(
    ctx: RequestContext,
    *,
    endpoint: str,
    model: str | None,
    outcome: str,
    status: int,
    served: Served | None = None,
) -> None:
    """The summary line of one request, generation or pass-through, when it ends (INFO; WARNING
    for a 5xx); ``served``: None for one refused before any instance was chosen."""
    level = logging.WARNING if status >= 500 else logging.INFO
    if not log.isEnabledFor(level):
        return
    prefill = served.prefill if served is not None else None
    decode = served.decode if served is not None else None
    fields: dict[str, Any] = {
        "request_id": served.request_id if served is not None else ctx.request_id,
        "client_request_id": ctx.client_id,
        "endpoint": endpoint,
        "model": model,
        "prefill": prefill.label if prefill is not None else None,
        "decode": decode.label if decode is not None else None,
        "outcome": outcome,
        "status": status,
        "timings": served.timings if served is not None else {},
    }
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, {}))
    log.log(level, "request %s", text, extra={_SUMMARY: fields})
