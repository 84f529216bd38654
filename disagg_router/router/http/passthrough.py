"""The routes beside generation, each forwarded to one instance of one of the model's pools.

Who calls it: the app (:mod:`disagg_router.router.http.app`) mounts one :class:`PassthroughEndpoint`
per path of :data:`PASSTHROUGH_PATHS` (served by the model's ``passthrough_pool``, the decode pool
unless configured) and one for :data:`RESPONSES_PATH` (always by D alone: docs/router.md,
"Endpoints"), and hands each its admission check (running, key, bounded body). The body gets the
JSON bounds and the ``model`` check of
:func:`disagg_router.router.http.validation.parse_passthrough` and goes to the instance unchanged
except for ``kv_transfer_params``, which only the router may set, and a client's ``priority``,
dropped once tenants or keys are configured
(:meth:`disagg_router.router.tenants.Directory.engine_body`). The instance is chosen by its pool's
policy among the usable ones (health, breaker, admission) and the exchange runs in
:mod:`disagg_router.router.dispatch.forward`; a retryable failure before any byte went to the client
is retried once on another instance when ``retry_on_fresh_pair`` is on, within the same
``timeouts.total``. The instance's answer goes back as it is (status, body, ``Content-Type``), event
streams as they come; the router's own errors are OpenAI-style JSON. Each request is counted
(``disagg_router_passthrough_*``), logged once when it ends (``logging.requests``) and waited for by
a drain, which aborts it with a 503 (or a final SSE error event) when its time is over; a client
that leaves cancels the work where it waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from disagg_router.router.dispatch.forward import Exchange, Forward, answer_ok, open_exchange
from disagg_router.router.errors import RouterError, outcome_label
from disagg_router.router.http.disconnect import ClientWatch, notice_of, watched
from disagg_router.router.http.exchange import DrainHandle, ProxiedStream
from disagg_router.router.http.generate import error_response, finish_request, request_context
from disagg_router.router.http.validation import parse_passthrough
from disagg_router.router.instances.state import Role
from disagg_router.router.runtime import Runtime
from disagg_router.router.tenants import Tenant
from disagg_router.router.upstream.rewrite import strip_client_fields

log = logging.getLogger(__name__)

PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
"""vLLM 0.32's non-generation POST routes a client calls with a model (each exists on an
instance only when its model supports it; vLLM's 404 or 501 then goes back as it is)."""

RESPONSES_PATH = "/v1/responses"

AdmitRaw = Callable[[Request], Awaitable[tuple[Runtime, bytes]]]
"""The app's checks before any upstream traffic: ``request -> (runtime, raw body)``."""


class PassthroughEndpoint:
    """The ASGI app of one pass-through path; ``role`` None: the model's ``passthrough_pool``."""

    def __init__(self, path: str, admit: AdmitRaw, role: Role | None = None) -> None:
        self.path = path
        self.admit = admit
        self.role = role

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        handle = DrainHandle()
        runtime: Runtime | None = getattr(request.app.state, "runtime", None)
        if runtime is not None:
            runtime.lifecycle.enter(handle)
        try:
            response = await self._forward(request, handle)
            await response(scope, receive, send)
        finally:
            if runtime is not None:
                runtime.lifecycle.leave(handle)

    async def _forward(self, request: Request, handle: DrainHandle) -> ASGIApp:
        """Admit, parse, open the exchange; then the answer, streamed or whole."""
        started = time.monotonic()
        ctx = request_context(request)
        watch: ClientWatch | None = None
        call: Forward | None = None
        try:
            runtime, raw = await self.admit(request)
            settings = runtime.settings
            model, body, _ = parse_passthrough(raw, settings.model_names, settings.limits)
            tenant: Tenant = request.state.tenant
            tenant.check_model(model, settings.model_names)
            body = runtime.tenancy.directory(settings).engine_body(body, tenant, assign=False)
            role = self.role or runtime.model(model).route.passthrough_pool
            headers = {k.lower(): v for k, v in request.headers.items()}
            call = Forward(self.path, model, strip_client_fields(body), role, headers)
            watch = ClientWatch(request.receive, notice_of(request.scope))  # the body is read
            exchange = await watched(watch, open_exchange(runtime, call, ctx.request_id), handle)
        except BaseException as exc:
            if watch is not None:
                watch.stop()
            if not isinstance(exc, RouterError):
                raise
            self._finish(request, call, outcome_label(exc), exc.status, started)
            return error_response(exc)

        def done(outcome: str) -> None:
            self._finish(request, call, outcome, exchange.answer.status, started, exchange)

        if exchange.streams:
            return ProxiedStream(exchange, watch, handle, done)
        return await self._whole(request, exchange, watch, handle, done)

    async def _whole(
        self,
        request: Request,
        exchange: Exchange,
        watch: ClientWatch,
        handle: DrainHandle,
        done: Callable[[str], None],
    ) -> Response:
        """The instance's answer read whole and given back as it is; the exchange is closed."""
        try:
            content = await watched(watch, exchange.body(), handle)
        except RouterError as exc:
            done(outcome_label(exc))
            return error_response(exc, {"X-Request-Id": exchange.request_id})
        finally:
            watch.stop()  # before close() awaits (disagg_router.router.http.disconnect)
            await exchange.close()
        done("ok" if answer_ok(exchange) else "upstream_rejected")
        answer = exchange.answer
        headers = {"X-Request-Id": exchange.request_id}
        if answer.content_type:
            headers["Content-Type"] = answer.content_type
        return Response(content, status_code=answer.status, headers=headers)

    def _finish(
        self,
        request: Request,
        call: Forward | None,
        outcome: str,
        status: int,
        started: float,
        exchange: Exchange | None = None,
    ) -> None:
        """Count and log the end of one pass-through request."""

        def count(runtime: Runtime) -> None:
            m = runtime.metrics
            m.child(m.passthrough.requests, self.path, outcome).inc()
            m.child(m.passthrough.seconds, self.path).observe(time.monotonic() - started)

        finish_request(
            request,
            count,
            endpoint=self.path,
            model=call.model if call else None,
            outcome=outcome,
            status=status,
            served=exchange,
        )
