"""The two generation endpoints (``/v1/completions``, ``/v1/chat/completions``): one client
request from its admission to the end of its answer.

Who calls it: the app (:mod:`disagg_router.router.http.app`) mounts one :class:`GenerationEndpoint`
per path and hands it the app's admission check (running, key, bounded body, valid input). The
endpoint opens a dispatch (:func:`disagg_router.router.dispatch.orchestrator.open_dispatch`; a
stream with :func:`disagg_router.router.dispatch.migration.open_stream`, which may continue it on
another D), then streams it (:class:`disagg_router.router.http.stream.DispatchStream`) or answers in
one piece; a :class:`~disagg_router.router.errors.RouterError` before the answer becomes
OpenAI-style JSON with its status. Every request is counted and (with ``logging.requests``) logged
once when it ends (an answered one also records its TTFT, latency and tokens, once); a client that
leaves cancels the work where it waits and the dispatch is still closed. Every response names the
request in ``X-Request-Id`` (the dispatch's id once one answered, else the request's): the request
guard (:mod:`disagg_router.router.http.guard`) relies on it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from disagg_router.router.dispatch.attempt import Dispatch
from disagg_router.router.dispatch.migration import Migrating, open_stream
from disagg_router.router.dispatch.orchestrator import open_dispatch
from disagg_router.router.errors import RateLimited, RouterError, error_payload, outcome_label
from disagg_router.router.http.disconnect import ClientWatch, notice_of, watched
from disagg_router.router.http.stream import DispatchStream
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.observability.reqlog import Served, log_request
from disagg_router.router.request import ClientRequest, RequestContext
from disagg_router.router.runtime import Runtime
from disagg_router.router.tenants import Pass, Tenant

log = logging.getLogger(__name__)

Admitted = tuple[Runtime, ClientRequest, Pass]
Admit = Callable[[Request, bool], Awaitable[Admitted]]
"""The app's checks before any upstream traffic: ``(request, chat) -> (runtime, request, pass)``
(the pass: the request's claim on its tenant's limits, :mod:`disagg_router.router.tenants`)."""


def request_context(request: Request) -> RequestContext:
    """The ids the request-id middleware gave this request (fresh ones if it gave none)."""
    ctx: RequestContext = getattr(request.state, "ctx", None) or RequestContext()
    return ctx


def finish_request(
    request: Request,
    count: Callable[[Runtime], None],
    *,
    endpoint: str,
    model: str | None,
    outcome: str,
    status: int,
    served: Served | None,
) -> None:
    """The end of one request of either kind (the generation endpoints', the pass-through
    routes'): ``count`` records it in the runtime's metrics, then its summary line is logged
    when ``logging.requests`` is on. Nothing happens without a runtime (the app not started)."""
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        return
    count(runtime)
    if runtime.settings.logging.requests:
        ctx = request_context(request)
        log_request(
            ctx, endpoint=endpoint, model=model, outcome=outcome, status=status, served=served
        )


def error_response(exc: RouterError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``exc`` as OpenAI-style JSON with its status, ``Retry-After`` when it has one, and
    ``Connection: close`` when the request stream cannot be trusted after it
    (:attr:`~disagg_router.router.errors.RouterError.closes_connection`): uvicorn then closes the
    connection once the answer is sent, whatever of the request is still unread."""
    headers = dict(headers or {})
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    if exc.closes_connection:
        headers["Connection"] = "close"
    return JSONResponse(error_payload(exc), status_code=exc.status, headers=headers)


class GenerationEndpoint:
    """The ASGI app of one generation path (``chat``: ``/v1/chat/completions``)."""

    def __init__(self, chat: bool, admit: Admit) -> None:
        self.chat = chat
        self.admit = admit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await generate(Request(scope, receive, send), self.chat, self.admit)
        await response(scope, receive, send)


async def generate(request: Request, chat: bool, admit: Admit) -> ASGIApp:
    """One generation request: admit, open a dispatch, then stream or answer in one piece."""
    ended = _Ending(request, "chat" if chat else "completions")
    req: ClientRequest | None = None
    watch: ClientWatch | None = None
    try:
        rt, req, ended.granted = await admit(request, chat)
        watch = ClientWatch(request.receive, notice_of(request.scope))  # the body is read
        ctx = request_context(request)
        opening = open_stream(rt, req, ctx) if req.stream else open_dispatch(rt, req, ctx)
        dispatch: Dispatch | Migrating = await watched(watch, opening)
    except BaseException as exc:
        if watch is not None:
            watch.stop()
        if not isinstance(exc, RouterError):
            ended.abandon()
            raise
        ended(outcome_label(exc), exc.status, req)
        return error_response(exc, ended.headers(request_context(request).request_id, exc))
    # TTFT: D's first token in hand (not streamed: D's whole answer, headers and body at once).
    times = ended.accepted, time.monotonic() - ended.accepted
    m, flag = rt.metrics, "true" if req.stream else "false"
    m.child(m.ttft, rt.settings.mode, req.model, flag).observe(times[1])
    if ended.tenant is not None:
        m.child(m.tenants.ttft, ended.tenant).observe(times[1])
    if req.stream:
        return DispatchStream(
            dispatch,
            watch,
            lambda d: ended(d.outcome, 200, req, d, times),
            ended.granted_headers(),
        )
    assert isinstance(dispatch, Dispatch)
    return await _answer(ended, req, dispatch, watch, times)


async def _answer(
    ended: _Ending,
    req: ClientRequest,
    dispatch: Dispatch,
    watch: ClientWatch,
    times: tuple[float, float],
) -> JSONResponse:
    """The non-streamed answer of an opened dispatch, which is closed here."""
    try:
        answer = await watched(watch, dispatch.json_response())
    except RouterError as exc:
        ended(outcome_label(exc), exc.status, req, dispatch)
        return error_response(exc, ended.headers(dispatch.request_id, exc))
    except BaseException:
        ended.abandon()  # cancelled: the pass goes back all the same
        raise
    finally:
        watch.stop()  # before close() awaits (disagg_router.router.http.disconnect)
        await dispatch.close()
    ended("ok", 200, req, dispatch, times)
    return JSONResponse(answer, headers=ended.headers(dispatch.request_id))


class _Ending:
    """The end of one generation request, once: counted, logged, its tenant's pass finished."""

    def __init__(self, request: Request, endpoint: str) -> None:
        self.request = request
        self.endpoint = endpoint
        self.accepted = time.monotonic()
        self.granted: Pass | None = None

    @property
    def tenant(self) -> str | None:
        """The caller's tenant name once identified (the ``tenant`` metric label)."""
        tenant: Tenant | None = getattr(self.request.state, "tenant", None)
        return tenant.name if tenant is not None else None

    def granted_headers(self) -> dict[str, str]:
        return self.granted.headers if self.granted is not None else {}

    def headers(self, request_id: str, exc: RouterError | None = None) -> dict[str, str]:
        """An answer's headers: its id and the tenant's rate-limit headers (a refusal's own)."""
        limits = exc.headers if isinstance(exc, RateLimited) else self.granted_headers()
        return {**limits, "X-Request-Id": request_id}

    def abandon(self) -> None:
        """The request's task is cancelled before an answer: only the pass is given back."""
        if self.granted is not None:
            self.granted.finish(None)

    def __call__(
        self,
        outcome: str,
        status: int,
        req: ClientRequest | None = None,
        dispatch: Dispatch | Migrating | None = None,
        times: tuple[float, float] | None = None,
    ) -> None:
        """Count and log the end; one answered in full (``ok``, with ``times``: accepted and
        its TTFT) also records its latency, tokens and time per token. The ``model`` label is
        "" for a request refused before its model was validated."""
        model = req.model if req is not None else ""
        usage = dispatch.usage if dispatch is not None else None
        if self.granted is not None:
            self.granted.finish(usage)
        tenant, endpoint = self.tenant, self.endpoint

        def count(runtime: Runtime) -> None:
            m = runtime.metrics
            m.child(m.requests, runtime.settings.mode, endpoint, model, outcome).inc()
            if tenant is not None:
                m.child(m.tenants.requests, tenant, outcome).inc()
                _count_tokens(m, tenant, usage, self.granted)
            if outcome == "ok" and times is not None and dispatch is not None and req is not None:
                e2e = (dispatch.answered or time.monotonic()) - times[0]
                m.answers.observe(model, req.stream, times[1], e2e, usage)

        finish_request(
            self.request,
            count,
            endpoint=endpoint,
            model=req.model if req else None,
            outcome=outcome,
            status=status,
            served=dispatch,
        )


def _count_tokens(m: RouterMetrics, tenant: str, usage: Any, granted: Pass | None) -> None:
    """A tenant's tokens: as the answer's usage reports them, else as charged on admission."""
    if isinstance(usage, dict):
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value > 0:
                m.child(m.tenants.tokens, tenant, kind).inc(value)
    elif granted is not None and granted.tokens > 0:
        m.child(m.tenants.tokens, tenant, "estimated").inc(granted.tokens)
