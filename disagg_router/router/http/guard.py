"""The outermost layer of every HTTP request: header bound, request id, trace span.

Who calls it: the app (:mod:`disagg_router.router.http.app`) wraps itself in one
:class:`RequestGuard`. For each request it checks the header size (431 in OpenAI error form,
``Connection: close``), builds the :class:`~disagg_router.router.request.RequestContext` (router's
id, the client's ``X-Request-Id`` when safe, a request span continuing the client's W3C
``traceparent`` when tracing is on) into ``request.state.ctx``, and puts ``X-Request-Id`` on the
response unless the handler set one (the dispatch id that answered). A ``POST`` to one of the
``direct`` paths (the generation endpoints) goes straight to its ASGI app, past the app's exception
middleware and router, which do nothing for those endpoints but cost CPU on every request
(docs/benchmarks/speed/profile.md); an error it raises still reaches the app's outermost error
handler. With tracing off, such an app's writes go to the server unwrapped: the generation endpoints
name the request (``X-Request-Id``) on every response they make themselves, so nothing needs to look
at each write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from disagg_router.router.config import LimitsConfig
from disagg_router.router.http.bounds import HeadersTooLarge, check_headers
from disagg_router.router.http.generate import error_response
from disagg_router.router.observability.tracing import NO_SPAN, NoTracer, Span
from disagg_router.router.request import RequestContext, safe_client_id

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

    def _span(self, scope: Scope, raw: Iterable[tuple[bytes, bytes]]) -> Span:
        runtime = getattr(scope["app"].state, "runtime", None)
        tracer = None if runtime is None else runtime.tracer
        if tracer is None or isinstance(tracer, NoTracer) or not scope["path"].startswith("/v1/"):
            return NO_SPAN
        name = f"{scope['method']} {scope['path']}"
        span: Span = tracer.request_span(name, Headers(raw=list(raw)))
        return span

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope["headers"]
        span = self._span(scope, raw)
        client_id = next((v for k, v in raw if k == _REQUEST_ID), None)
        ctx = RequestContext(
            client_id=safe_client_id(None if client_id is None else client_id.decode("latin-1")),
            trace=span,
        )
        scope.setdefault("state", {})["ctx"] = ctx
        app = self.app
        if scope["method"] == "POST" and not scope.get("root_path"):
            app = self.direct.get(scope["path"], app)
        if app is not self.app and span is NO_SPAN:
            # A generation endpoint names its request on every response it makes, and no span
            # needs the status: no wrapper around each of its writes.
            await self._checked(app, scope, receive, send, ctx, span)
            return
        span.set("request_id", ctx.request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_request_id(message.get("headers", ()), ctx.request_id)
                span.set("http.status_code", str(message["status"]))
            await send(message)

        await self._checked(app, scope, receive, send_with_id, ctx, span)

    async def _checked(
        self,
        app: ASGIApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        ctx: RequestContext,
        span: Span,
    ) -> None:
        """``app`` for the request, unless its headers exceed the bound (a 431 then)."""
        try:
            check_headers(scope["headers"], self.limits)
        except HeadersTooLarge as exc:
            response = error_response(exc, {"X-Request-Id": ctx.request_id})
            await response(scope, receive, send)
            span.end(exc.message)
            return
        try:
            await app(scope, receive, send)
        finally:
            span.end()
