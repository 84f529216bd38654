"""The router's ASGI app: OpenAI-compatible endpoints in front of the P and D pools.

Who calls it: ``disagg-router serve`` (via uvicorn) and tests. ``create_app(settings,
transport=...)`` builds one app; its lifespan builds the app's one :class:`Runtime` (the shared
``httpx.AsyncClient`` with explicit timeouts and an optional injected transport, its own metrics
registry, the per-model pools), runs the first health check / identity discovery, starts the
periodic monitor and the load-signal scraper, and closes everything on shutdown. Built with the
config file's path (``disagg-router serve``), it also reloads that file on SIGHUP and, with
``reload.watch``, whenever the file changes (:mod:`router.reload`).
All :class:`RouterError` are translated to OpenAI-style JSON here and only here.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from router.backends import BackendState
from router.config import RouterSettings
from router.dispatch import Dispatch
from router.errors import (
    AuthenticationError,
    ClientDisconnected,
    ClientRequestError,
    RouterError,
    RouterNotReady,
    error_payload,
    outcome_label,
)
from router.health import HealthMonitor
from router.load_signals import run_scraper
from router.orchestrator import open_dispatch
from router.reload import ConfigReloader
from router.runtime import Runtime, open_runtime
from router.validation import parse_client_request

T = TypeVar("T")
log = logging.getLogger(__name__)


def _runtime(request: Request) -> Runtime:
    """The app's runtime; a 503 while the lifespan has not built it (or has torn it down)."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise RouterNotReady("the router is not running yet")
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


def _signal_targets(runtime: Runtime) -> list[BackendState]:
    return [
        b for pool in runtime.pools if pool.config.policy == "power_of_two" for b in pool.backends
    ]


def _on_sighup(reloader: ConfigReloader) -> bool:
    """Reload on SIGHUP; False where signals cannot be handled (not the main thread)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloader.reload)
    except (RuntimeError, ValueError, NotImplementedError):
        log.debug("SIGHUP reload unavailable outside the main thread")
        return False
    return True


def _lifespan(
    settings: RouterSettings,
    transport: httpx.AsyncBaseTransport | None,
    config_path: Path | None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_runtime(settings, transport) as runtime:
            monitor = HealthMonitor(runtime)
            await monitor.check_all()
            tasks = [
                asyncio.create_task(monitor.run()),
                asyncio.create_task(
                    run_scraper(
                        runtime.client,
                        lambda: _signal_targets(runtime),
                        lambda: runtime.settings.load_signals.interval,
                        settings.timeouts.health,
                    )
                ),
            ]
            reloader = None
            sighup = False
            if config_path is not None:
                reloader = ConfigReloader(runtime, config_path, monitor.check_some)
                sighup = _on_sighup(reloader)
                if settings.reload.watch:
                    tasks.append(asyncio.create_task(reloader.watch()))
            app.state.runtime = runtime
            app.state.reloader = reloader
            try:
                yield
            finally:
                app.state.runtime = None
                if sighup:
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if reloader is not None:
                    await reloader.close()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as OpenAI-style JSON."""

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(ClientRequestError(str(exc.detail), None, status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        return _error_response(RouterError("internal router error; see the router log"))


def _record(runtime: Runtime, endpoint: str, outcome: str) -> None:
    runtime.metrics.requests.labels(runtime.settings.mode, endpoint, outcome).inc()


def _settings(request: Request) -> RouterSettings:
    """The config in force: the runtime's (hot reload may replace it), else the app's initial."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        return runtime.settings
    initial: RouterSettings = request.app.state.settings
    return initial


async def _generate(request: Request, chat: bool) -> Response:
    """One generation request: validate, open a dispatch, then stream or answer in one piece."""
    settings = _settings(request)
    endpoint = "chat" if chat else "completions"
    accepted = time.monotonic()
    try:
        _authorize(request, settings.api_keys)
        headers = {k.lower(): v for k, v in request.headers.items()}
        req = parse_client_request(await request.body(), chat, settings.model_names, headers)
        rt = _runtime(request)
        dispatch = await _unless_disconnected(request, open_dispatch(rt, req))
    except RouterError as exc:
        runtime = getattr(request.app.state, "runtime", None)
        if runtime is not None:
            _record(runtime, endpoint, outcome_label(exc))
        return _error_response(exc)
    if req.stream:
        rt.metrics.ttft.labels(settings.mode).observe(time.monotonic() - accepted)
        return _DispatchStream(dispatch, lambda d: _record(rt, endpoint, d.outcome))
    try:
        answer = await _unless_disconnected(request, dispatch.json_response())
    except RouterError as exc:
        _record(rt, endpoint, outcome_label(exc))
        return _error_response(exc)
    finally:
        await dispatch.close()
    _record(rt, endpoint, "ok")
    return JSONResponse(answer, headers={"X-Request-Id": dispatch.request_id})


def _routes() -> APIRouter:
    """The router's HTTP endpoints; each reads settings and runtime from its app."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        settings = _settings(request)
        _authorize(request, settings.api_keys)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "disagg-router"}
            for m in settings.model_names
        ]
        return {"object": "list", "data": data}

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        runtime = _runtime(request)
        models = {}
        for name, found in runtime.routing.table.models.items():
            p = [b.label for b in found.prefill.usable()]
            d = [b.label for b in found.decode.usable()]
            models[name] = {"ready": bool(p and d), "prefill": p, "decode": d}
        ok = all(m["ready"] for m in models.values())
        first = next(iter(models.values()))  # top-level prefill/decode: the first model's
        body = {
            "ready": ok,
            "mode": runtime.settings.mode,
            "prefill": first["prefill"],
            "decode": first["decode"],
            "models": models,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        return Response(_runtime(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return api


def create_app(
    settings: RouterSettings,
    transport: httpx.AsyncBaseTransport | None = None,
    config_path: Path | None = None,
) -> FastAPI:
    """Build the router app for ``settings``; ``transport`` replaces the network (tests);
    ``config_path``: the file ``settings`` came from, reloaded on SIGHUP (and, with
    ``reload.watch``, on change).

    The app's :class:`Runtime` (client, metrics, pools) exists while its lifespan runs.
    """
    app = FastAPI(title="disagg-router", lifespan=_lifespan(settings, transport, config_path))
    app.state.settings = settings
    app.state.runtime = None
    _add_error_handlers(app)
    app.include_router(_routes())
    return app
