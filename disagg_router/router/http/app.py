"""The router's ASGI app: OpenAI-compatible endpoints in front of the P and D pools.

Who calls it: ``disagg-router serve`` (via :mod:`disagg_router.router.server`) and tests.
``create_app(settings)`` builds one app; its lifespan builds the app's one :class:`Runtime` (the one
upstream client with explicit timeouts, its own metrics registry, the per-model pools, the tracer,
the start/stop state) and starts the health monitor and the load-signal scraper in the background,
so ``/health`` answers at once while slow instances are still being checked (``/ready`` says what is
missing). Built with the config file's path (``disagg-router serve``), it also reloads that file on
SIGHUP and, with ``reload.watch``, whenever the file changes (:mod:`disagg_router.router.reload`).
The generation endpoints are :mod:`disagg_router.router.http.generate`'s, given this app's admission
check; the routes beside them (``/tokenize``, ``/v1/embeddings``, pooling, scoring,
``/v1/responses``, ...) are :mod:`disagg_router.router.http.passthrough`'s, and ``/v1/models`` lists
:mod:`disagg_router.router.http.models`' cards. Every response carries ``X-Request-Id``. Every
:class:`RouterError` that reaches a client is OpenAI-style JSON built by
:func:`disagg_router.router.errors.error_payload`: in :mod:`disagg_router.router.http.generate` for
responses (also this app's exception handlers and the pass-through routes), in
:mod:`disagg_router.router.http.guard` for a header bound (431, before the app runs), and in the
dispatch's relay (:mod:`disagg_router.router.dispatch.relay`) as the final SSE error event of a
stream that already started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from disagg_router.router.config import RouterSettings
from disagg_router.router.discovery.manager import DiscoveryManager
from disagg_router.router.errors import (
    ClientRequestError,
    RouterError,
    RouterNotReady,
)
from disagg_router.router.health.load_signals import run_scraper
from disagg_router.router.health.monitor import HealthMonitor
from disagg_router.router.health.readiness import (
    HEALTH_MONITOR,
    ReadinessCollector,
    await_first_check,
    readiness,
)
from disagg_router.router.http.bounds import read_body
from disagg_router.router.http.generate import (
    Admitted,
    GenerationEndpoint,
    error_response,
    request_context,
)
from disagg_router.router.http.guard import RequestGuard
from disagg_router.router.http.models import model_list
from disagg_router.router.http.passthrough import (
    PASSTHROUGH_PATHS,
    RESPONSES_PATH,
    PassthroughEndpoint,
)
from disagg_router.router.http.validation import parse_client_request
from disagg_router.router.instances.state import BackendState
from disagg_router.router.reload import ConfigReloader
from disagg_router.router.request import ClientRequest
from disagg_router.router.routing.prompt_keys import estimated_tokens, prompt_of
from disagg_router.router.runtime import Runtime, open_runtime
from disagg_router.router.supervisor import Supervisor
from disagg_router.router.tenants import Directory, Tenant

log = logging.getLogger(__name__)


def _runtime(request: Request) -> Runtime:
    """The app's runtime; a 503 while the lifespan has not built it (or has torn it down)."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise RouterNotReady("the router is not running yet")
    return runtime


def _settings(request: Request) -> RouterSettings:
    """The config in force: the runtime's (hot reload may replace it), else the app's initial."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        return runtime.settings
    initial: RouterSettings = request.app.state.settings
    return initial


def _identify(request: Request, settings: RouterSettings) -> Tenant:
    """The caller's tenant (:mod:`disagg_router.router.tenants`), kept on the request's state for
    the endpoint's metrics; 401 when keys are required and the request has no known one."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        directory = runtime.tenancy.directory(settings)
    else:
        directory = Directory(settings.tenancy, settings.api_keys)
    tenant = directory.identify(request.headers.get("authorization", ""))
    request.state.tenant = tenant
    return tenant


def _signal_targets(runtime: Runtime) -> list[BackendState]:
    """Instances whose load signals are read: those of pools whose policy compares loads, and
    every D when push.bind is adaptive (it reads D's KV usage)."""
    settings = runtime.settings
    adaptive = settings.mode == "push" and settings.push.bind == "adaptive"
    return [
        b
        for pool in runtime.pools
        if "load" in pool.policy.signals or (adaptive and pool.role == "decode")
        for b in pool.backends
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
    settings: RouterSettings, config_path: Path | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_runtime(settings) as runtime:
            runtime.tenancy.configure(settings)
            supervisor = Supervisor(runtime.metrics)
            monitor = HealthMonitor(runtime)
            discovery = DiscoveryManager(runtime, monitor.check_some, supervisor=supervisor)
            discovery.sync()
            supervisor.start(HEALTH_MONITOR, monitor.run)
            supervisor.start(
                "load_scraper",
                lambda: run_scraper(
                    runtime.client,
                    lambda: list({id(b): b for b in _signal_targets(runtime)}.values()),
                    lambda: runtime.settings.load_signals.interval,
                    settings.timeouts.health,
                ),
            )
            supervisor.start(
                "kv_routing", lambda: runtime.kv.run(runtime.routing, runtime.metrics.kv)
            )
            reloader = None
            sighup = False
            if config_path is not None:
                reloader = ConfigReloader(
                    runtime, config_path, monitor.check_some, on_applied=discovery.sync
                )
                sighup = _on_sighup(reloader)
                if settings.reload.watch:
                    supervisor.start("config_watch", reloader.watch)
            collector = ReadinessCollector(runtime, supervisor, discovery)
            runtime.metrics.registry.register(collector)
            app.state.runtime = runtime
            app.state.reloader = reloader
            app.state.discovery = discovery
            app.state.supervisor = supervisor
            try:
                yield
            finally:
                app.state.runtime = None
                runtime.metrics.registry.unregister(collector)
                if sighup:
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                await discovery.close()
                await supervisor.close()
                if reloader is not None:
                    await reloader.close()
                await runtime.tenancy.close()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as OpenAI-style JSON with the request id."""

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(ClientRequestError(str(exc.detail), None, status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error", exc_info=exc)
        err = RouterError("internal router error; see the router log")
        return error_response(err, {"X-Request-Id": request_context(request).request_id})


async def _admitted_body(request: Request) -> tuple[Runtime, bytes]:
    """Checks before any upstream traffic: running and not draining, key, bounded body."""
    runtime = _runtime(request)
    settings = runtime.settings
    if runtime.lifecycle.draining:
        raise RouterNotReady(
            "the router is shutting down", retry_after=settings.admission.retry_after
        )
    _identify(request, settings)
    return runtime, await read_body(request, settings.limits)


async def _admitted_request(request: Request, chat: bool) -> Admitted:
    """Checks before any upstream traffic: running and not draining, key, bounded body, input,
    the tenant's models and limits. The request's context gets the tenant's queue claim."""
    runtime, raw = await _admitted_body(request)
    settings = runtime.settings
    headers = {
        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.scope["headers"]
    }
    req = parse_client_request(raw, chat, settings.model_names, headers, settings.limits)
    tenant: Tenant = request.state.tenant
    tenant.check_model(req.model, settings.model_names)
    await await_first_check(runtime, getattr(request.app.state, "supervisor", None))
    tokens = _charged_tokens(runtime, req) if tenant.limits.tokens_per_minute else 0
    granted = await runtime.tenancy.limiter.admit(tenant, tokens)
    request.state.ctx = replace(request_context(request), claim=tenant.claim)
    body = runtime.tenancy.directory(settings).engine_body(req.body, tenant)
    return runtime, req if body is req.body else replace(req, body=body), granted


def _charged_tokens(runtime: Runtime, req: ClientRequest) -> int:
    """What a request is charged on admission against ``tokens_per_minute``: its estimated
    prompt tokens plus the completion tokens it allows (corrected by the answer's usage)."""
    per_token = runtime.model(req.model).route.disaggregation.chars_per_token
    prompt = estimated_tokens(prompt_of(req.body, req.chat), per_token)
    limits = [req.body.get(k) for k in ("max_completion_tokens", "max_tokens")]
    return prompt + next((n for n in limits if isinstance(n, int)), 0)


async def _admitted_passthrough(request: Request) -> tuple[Runtime, bytes]:
    """A pass-through request's checks: those of :func:`_admitted_body`, then the wait for the
    first health checks (its body is judged by :mod:`disagg_router.router.http.passthrough`)."""
    runtime, raw = await _admitted_body(request)
    await await_first_check(runtime, getattr(request.app.state, "supervisor", None))
    return runtime, raw


def _readiness(runtime: Runtime, discovery: DiscoveryManager | None) -> JSONResponse:
    """200 when every model can be served (a usable D, and a usable P or a rule that serves by
    D alone) and the router is not draining; the body says what is missing or degraded, how
    each discovered pool's discovery fares and how the background tasks fare
    (:mod:`disagg_router.router.health.readiness`)."""
    found = discovery.status() if discovery is not None else {}
    tasks = discovery.supervisor.status() if discovery is not None else {}
    now = readiness(runtime, found, tasks)
    body = {**now.body, "kv_events": kv} if (kv := runtime.kv.status()) else now.body
    return JSONResponse(body, status_code=200 if now.ready else 503)


def _generation() -> dict[str, GenerationEndpoint]:
    """The generation endpoints by path: plain ASGI apps that read the raw request themselves,
    so FastAPI's per-request dependency solving bought nothing on the hot path
    (docs/benchmarks/README.md); the request guard calls them directly."""
    return {
        path: GenerationEndpoint(chat, _admitted_request)
        for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True))
    }


def _routes(generation: dict[str, GenerationEndpoint]) -> APIRouter:
    """The router's HTTP endpoints; each reads settings and runtime from its app."""
    api = APIRouter()
    for path, endpoint in generation.items():
        api.routes.append(Route(path, endpoint, methods=["POST"]))

    for path in PASSTHROUGH_PATHS:
        api.routes.append(
            Route(path, PassthroughEndpoint(path, _admitted_passthrough), methods=["POST"])
        )
    responses = PassthroughEndpoint(RESPONSES_PATH, _admitted_passthrough, role="decode")
    api.routes.append(Route(RESPONSES_PATH, responses, methods=["POST"]))

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        settings = _settings(request)
        tenant = _identify(request, settings)
        cards = model_list(settings, getattr(request.app.state, "runtime", None))
        allowed = tenant.limits.models
        if allowed is not None:
            cards["data"] = [c for c in cards["data"] if c["id"] in allowed]
        return cards

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        return _readiness(_runtime(request), getattr(request.app.state, "discovery", None))

    @api.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        runtime = _runtime(request)
        text = runtime.metrics.render(runtime.backends())
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return api


def create_app(settings: RouterSettings, config_path: Path | None = None) -> FastAPI:
    """Build the router app for ``settings``; ``config_path``: the file ``settings`` came from,
    reloaded on SIGHUP (and, with ``reload.watch``, on change).

    The app's :class:`Runtime` (client, metrics, pools, tracer, lifecycle) exists while its
    lifespan runs. Interactive API docs exist only with ``limits.docs: true``.
    """
    docs = settings.limits.docs
    app = FastAPI(
        title="disagg-router",
        lifespan=_lifespan(settings, config_path),
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.settings = settings
    app.state.runtime = None
    _add_error_handlers(app)
    generation = _generation()
    app.include_router(_routes(generation))
    app.add_middleware(RequestGuard, limits=settings.limits, direct=generation)
    return app
