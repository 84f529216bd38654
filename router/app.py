"""The router's ASGI app: OpenAI-compatible endpoints in front of the P and D pools.

Who calls it: ``disagg-router serve`` (via uvicorn) and tests. ``create_app(settings,
transport=...)`` builds one app with its own metrics registry; the lifespan opens the one shared
``httpx.AsyncClient`` (explicit timeouts, optional injected transport), runs the first health
check / identity discovery, starts the periodic monitor, and closes everything on shutdown.
All :class:`RouterError` are translated to OpenAI-style JSON here and only here.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from router.config import RouterSettings
from router.dispatch import Dispatch, DispatchContext
from router.errors import (
    AuthenticationError,
    ClientDisconnected,
    RouterError,
    error_payload,
    outcome_label,
)
from router.health import HealthMonitor
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.pools import Pool
from router.validation import parse_client_request

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class RouterRuntime:
    """Per-app objects; ``orchestrator`` and ``monitor`` exist while the lifespan runs."""

    settings: RouterSettings
    metrics: RouterMetrics
    prefill_pool: Pool
    decode_pool: Pool
    orchestrator: Orchestrator | None = None
    monitor: HealthMonitor | None = None


def _runtime(request: Request) -> RouterRuntime:
    runtime: RouterRuntime = request.app.state.runtime
    return runtime


def _error_response(exc: RouterError) -> JSONResponse:
    return JSONResponse(error_payload(exc), status_code=exc.status)


def _authorize(request: Request, keys: list[str]) -> None:
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and any(hmac.compare_digest(token, k) for k in keys):
        return
    raise AuthenticationError("Incorrect or missing API key (Authorization: Bearer <key>)")


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected("client disconnected")
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class _DispatchStream(StreamingResponse):
    """SSE response that always closes its dispatch, however the stream ends."""

    def __init__(self, dispatch: Dispatch, on_close: Callable[[Dispatch], None]) -> None:
        super().__init__(dispatch.sse_events(), media_type="text/event-stream")
        self.dispatch = dispatch
        self.on_close = on_close
        self.headers["X-Request-Id"] = dispatch.request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.dispatch.outcome == "in_progress":
                self.dispatch.outcome = "client_disconnected"
            await self.dispatch.close()
            self.on_close(self.dispatch)


def create_app(
    settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """Build the router app for ``settings``; ``transport`` replaces the network (tests)."""
    metrics = RouterMetrics(CollectorRegistry())
    runtime = RouterRuntime(
        settings=settings,
        metrics=metrics,
        prefill_pool=Pool("prefill", settings.prefill, require_identity=settings.mode == "push"),
        decode_pool=Pool("decode", settings.decode, require_identity=False),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        t = settings.timeouts
        timeout = httpx.Timeout(connect=t.connect, read=t.total, write=t.total, pool=t.connect)
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            pools = [runtime.prefill_pool, runtime.decode_pool]
            runtime.monitor = HealthMonitor(settings, client, pools, metrics)
            runtime.orchestrator = Orchestrator(DispatchContext(settings, client, metrics), *pools)
            await runtime.monitor.check_all()
            monitor_task = asyncio.create_task(runtime.monitor.run())
            try:
                yield
            finally:
                monitor_task.cancel()
                await asyncio.gather(monitor_task, return_exceptions=True)

    app = FastAPI(title="disagg-router", lifespan=lifespan)
    app.state.runtime = runtime

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = RouterError(str(exc.detail))
        err.status = exc.status_code
        err.error_type = "invalid_request_error"
        return _error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        return _error_response(RouterError("internal router error; see the router log"))

    def record(endpoint: str, outcome: str) -> None:
        metrics.requests.labels(settings.mode, endpoint, outcome).inc()

    async def generate(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        accepted = time.monotonic()
        rt = _runtime(request)
        try:
            _authorize(request, settings.api_keys)
            req = parse_client_request(await request.body(), chat, settings.models)
            assert rt.orchestrator is not None
            dispatch = await _unless_disconnected(request, rt.orchestrator.open(req))
        except RouterError as exc:
            record(endpoint, outcome_label(exc))
            return _error_response(exc)
        if req.stream:
            metrics.ttft.labels(settings.mode).observe(time.monotonic() - accepted)
            return _DispatchStream(dispatch, lambda d: record(endpoint, d.outcome))
        try:
            answer = await _unless_disconnected(request, dispatch.json_response())
        except RouterError as exc:
            record(endpoint, outcome_label(exc))
            return _error_response(exc)
        finally:
            await dispatch.close()
        record(endpoint, "ok")
        return JSONResponse(answer, headers={"X-Request-Id": dispatch.request_id})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, settings.api_keys)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "disagg-router"}
            for m in settings.models
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        p = [b.label for b in runtime.prefill_pool.usable()]
        d = [b.label for b in runtime.decode_pool.usable()]
        status = 200 if p and d else 503
        body = {"ready": status == 200, "mode": settings.mode, "prefill": p, "decode": d}
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
