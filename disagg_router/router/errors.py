"""The router's one exception tree and its translation into OpenAI-style error JSON.

Who raises: config loading, request validation, upstream calls and orchestration. Who translates:
the edge only, through :func:`error_payload` (the app's responses, the request guard's 431, a
started stream's final SSE error event), never the code that raises. Upstream transport errors
are wrapped with ``raise ... from exc`` by :mod:`disagg_router.router.upstream.calls`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class RouterError(Exception):
    """Base of every error the router raises on purpose."""

    status: int = 500
    error_type: str = "internal_error"
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None  # seconds; sent as ``Retry-After`` when set
    closes_connection: bool = False
    """True where the client's request stream cannot be trusted after this error (part of the
    body or headers is unread): the answer says ``Connection: close`` and the server closes the
    connection after it."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = self.retry_after if retry_after is None else retry_after
        self.status = self.status if status is None else status
        self.error_type = self.error_type if error_type is None else error_type
        self.param = self.param if param is None else param
        self.code = self.code if code is None else code


class ConfigError(RouterError):
    """The config file or mapping is invalid; ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", param=field)
        self.field = field


class ClientRequestError(RouterError):
    """The client's request is malformed (400) or names an unknown model (404)."""

    error_type = "invalid_request_error"

    def __init__(
        self, message: str, param: str | None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message, status=status, param=param, code=code)


class ModelNotFound(ClientRequestError):
    """404: the request names a model the router does not serve (the message lists those it
    does). The one model-404: raised by input validation (before anything else is looked at)
    and by :meth:`disagg_router.router.routing.table.RoutingTable.lookup` (a reload may have dropped
    the model since)."""

    def __init__(self, model: str, served: Iterable[str]) -> None:
        super().__init__(
            f"The model `{model}` does not exist; served models: {', '.join(served)}",
            "model",
            status=404,
            code="model_not_found",
        )


class AuthenticationError(RouterError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class NoBackendAvailable(RouterError):
    """No usable instance in a pool (all unhealthy, or no known push identity)."""

    status = 503
    error_type = "service_unavailable"


class RouterNotReady(RouterError):
    """The router's runtime is not up (starting), or it is draining before it stops."""

    status = 503
    error_type = "service_unavailable"


class Overloaded(RouterError):
    """No slot on an instance within the admission bounds (queue full or wait too long)."""

    status = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class RateLimited(RouterError):
    """429: over one of the tenant's own limits (``tenancy``): ``limit`` is ``requests`` or
    ``tokens`` (per minute) or ``concurrent``. ``headers``: the answer's rate-limit headers
    (:mod:`disagg_router.router.tenants.headers`), complete when raised."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(
        self, message: str, limit: str, retry_after: int, headers: Mapping[str, str]
    ) -> None:
        super().__init__(message, error_type=limit, retry_after=retry_after)
        self.limit = limit
        self.headers = dict(headers)


class PayloadTooLarge(RouterError):
    """The request body exceeds ``limits.max_body_bytes``."""

    status = 413
    error_type = "invalid_request_error"
    closes_connection = True


class BodyTimeout(RouterError):
    """The request body did not arrive within ``limits.body_timeout``."""

    status = 408
    error_type = "invalid_request_error"
    closes_connection = True


class UpstreamError(RouterError):
    """A P or D leg failed. ``leg`` is ``prefill`` or ``decode``; ``backend`` its label.

    ``retryable`` says whether retrying the request on a fresh pair may succeed;
    ``instance_fault`` whether the failure counts against the instance's health (a 4xx, the
    client's fault, does not); ``unreachable`` whether the instance could not be reached at all.
    """

    status = 502
    error_type = "upstream_error"
    retryable = True
    instance_fault = True
    unreachable = False

    def __init__(
        self,
        leg: str,
        backend: str,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        verbatim: bool = False,
    ) -> None:
        """``verbatim``: ``message`` is shown as is, not prefixed with the leg and instance."""
        text = message if verbatim else f"{leg} instance {backend}: {message}"
        super().__init__(text, status=status, error_type=error_type)
        self.leg = leg
        self.backend = backend


class UpstreamUnavailable(UpstreamError):
    """Could not connect, or the connection broke."""

    status = 503
    error_type = "service_unavailable"


class UpstreamUnreachable(UpstreamUnavailable):
    """The connection to the instance could not be opened (refused, unreachable)."""

    unreachable = True


class UpstreamTimeout(UpstreamError):
    """A bounded wait (prefill, first token, total, connect) ran out."""

    status = 504
    error_type = "timeout"


class UpstreamConnectTimeout(UpstreamTimeout):
    """Opening the connection to the instance timed out."""

    unreachable = True


class UpstreamHTTPError(UpstreamError):
    """The instance answered with an HTTP error; 4xx are the client's fault and not retried."""

    def __init__(self, leg: str, backend: str, status: int, detail: Any) -> None:
        message = _upstream_message(detail) or f"HTTP {status}"
        rejected = 400 <= status < 500
        super().__init__(
            leg,
            backend,
            message,
            status=status if rejected else 502,
            error_type="invalid_request_error" if rejected else None,
            verbatim=rejected,  # the client's own fault: vLLM's words
        )
        self.upstream_status = status
        self.retryable = not rejected
        self.instance_fault = not rejected


class UpstreamProtocolError(UpstreamError):
    """The instance answered something the router cannot use (bad JSON, missing fields)."""


def _upstream_message(detail: Any) -> str | None:
    if isinstance(detail, dict):
        err = detail.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(detail.get("message"), str):
            return str(detail["message"])
    if isinstance(detail, str) and detail:
        return detail[:500]
    return None


def error_payload(exc: RouterError) -> dict[str, Any]:
    """OpenAI-style error body for ``exc``: ``{"error": {message, type, param, code}}``."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.code if exc.code is not None else exc.status,
        }
    }


class ClientDisconnected(RouterError):
    """The client went away before the answer was ready; nobody reads this error."""

    status = 499
    error_type = "client_closed_request"
    closes_connection = True


def outcome_label(exc: RouterError) -> str:
    """The ``outcome`` metric label for a request that ended with ``exc``."""
    if isinstance(exc, UpstreamHTTPError) and not exc.retryable:
        return "upstream_rejected"
    if isinstance(exc, UpstreamTimeout):
        return f"{exc.leg}_timeout"
    if isinstance(exc, UpstreamError):
        return f"{exc.leg}_failed"
    labels: dict[type[RouterError], str] = {
        ClientRequestError: "invalid_request",
        ModelNotFound: "invalid_request",
        AuthenticationError: "unauthorized",
        NoBackendAvailable: "no_backend",
        ClientDisconnected: "client_disconnected",
        Overloaded: "overloaded",
        RateLimited: "rate_limited",
        RouterNotReady: "not_ready",
        PayloadTooLarge: "invalid_request",
        BodyTimeout: "invalid_request",
    }
    return labels.get(type(exc), "error")
