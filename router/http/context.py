"""What the router knows about one client HTTP request across its dispatch attempts.

Who builds it: the app's request-id middleware (one per HTTP request). ``request_id`` is the
router's own unique id (the first dispatch attempt uses it for both legs; a retry gets a fresh
one); ``client_id`` is the client's ``X-Request-Id`` when it is safe to log (never sent to vLLM).
``trace`` is the tracing span of the request (a no-op one when tracing is off).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from router.dispatch.ids import new_request_id
from router.observability.tracing import NO_SPAN, Span

_SAFE_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def safe_client_id(value: str | None) -> str | None:
    """``value`` if it is a short id of safe characters (fit for logs), else None."""
    if value is not None and _SAFE_CLIENT_ID.fullmatch(value):
        return value
    return None


@dataclass(frozen=True)
class RequestContext:
    """Ids (and the trace span) of one client request."""

    request_id: str = field(default_factory=new_request_id)
    client_id: str | None = None
    trace: Span = NO_SPAN
