"""The outermost layer of every HTTP request: header bound, request id, trace span.

Who calls it: the app (:mod:`router.http.app`) wraps itself in one :class:`RequestGuard`. For each
request it checks the header size (431 in OpenAI error form), builds the
:class:`~router.request.RequestContext` (router's id, the client's ``X-Request-Id`` when safe,
a request span continuing the client's W3C ``traceparent`` when tracing is on) into
``request.state.ctx``, and puts ``X-Request-Id`` on the response unless the handler set one (the
dispatch id that answered). A ``POST`` to one of the ``direct`` paths (the generation endpoints)
goes straight to its ASGI app, past the app's exception middleware and router, which do nothing
for those endpoints but cost CPU on every request (docs/benchmarks/speed/profile.md); an error
it raises still reaches the app's outermost error handler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import LimitsConfig
from router.errors import error_payload
from router.http.bounds import HeadersTooLarge, check_headers
from router.observability.tracing import NO_SPAN, Span
from router.request import RequestContext, safe_client_id

_REQUEST_ID = b"x-request-id"


def with_request_id(
    headers: Iterable[tuple[bytes, bytes]], request_id: str
) -> list[tuple[bytes, bytes]]:
    """A response's raw headers with ``X-Request-Id: request_id`` added unless one is there
    (as Starlette's ``MutableHeaders`` would add it, without building one per response)."""
    raw = list(headers)
    for name, _ in raw:
        if name == _REQUEST_ID:
            return raw
    raw.append((_REQUEST_ID, request_id.encode("latin-1")))
    return raw


class RequestGuard:
    """ASGI middleware (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, limits: LimitsConfig, direct: Mapping[str, ASGIApp] | None = None
    ) -> None:
        """``direct``: path -> the ASGI app that answers a ``POST`` there (see the module doc)."""
        self.app = app
        self.limits = limits
        self.direct = dict(direct or {})

    def _span(self, scope: Scope, headers: Headers) -> Span:
        runtime = getattr(scope["app"].state, "runtime", None)
        if runtime is None or not scope["path"].startswith("/v1/"):
            return NO_SPAN
        span: Span = runtime.tracer.request_span(f"{scope['method']} {scope['path']}", headers)
        return span

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        span = self._span(scope, headers)
        ctx = RequestContext(client_id=safe_client_id(headers.get("x-request-id")), trace=span)
        span.set("request_id", ctx.request_id)
        scope.setdefault("state", {})["ctx"] = ctx

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_request_id(message.get("headers", ()), ctx.request_id)
                span.set("http.status_code", str(message["status"]))
            await send(message)

        try:
            check_headers(scope["headers"], self.limits)
        except HeadersTooLarge as exc:
            response = JSONResponse(error_payload(exc), status_code=exc.status)
            await response(scope, receive, send_with_id)
            span.end(exc.message)
            return
        app = self.app
        if scope["method"] == "POST" and not scope.get("root_path"):
            app = self.direct.get(scope["path"], app)
        try:
            await app(scope, receive, send_with_id)
        finally:
            span.end()
