"""OpenTelemetry tracing end to end on loopback: a client's W3C traceparent is continued, both
legs carry the trace to vLLM, and the spans (request, prefill, decode, first_token) reach an OTLP
collector; with tracing off no OpenTelemetry module is even imported."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devstack.fake_vllm import FakeVllmServer, UvicornThread
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _collector(spans: list[tuple[str, str]], lock: threading.Lock) -> FastAPI:
    """An OTLP/HTTP trace receiver that records (span name, trace id hex)."""
    app = FastAPI()

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        export = ExportTraceServiceRequest.FromString(await request.body())
        with lock:
            for resource in export.resource_spans:
                for scope in resource.scope_spans:
                    spans.extend((s.name, s.trace_id.hex()) for s in scope.spans)
        return Response(status_code=200)

    return app


def test_trace_is_continued_propagated_to_both_legs_and_exported(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d = fake["p0"], fake["d0"]
    spans: list[tuple[str, str]] = []
    lock = threading.Lock()
    with UvicornThread(_collector(spans, lock)) as collector:
        tracing: dict[str, Any] = {"enabled": True, "endpoint": f"{collector.url}/v1/traces"}
        settings = make_settings([p.url], [d.url], tracing=tracing)
        with running_router(settings) as router:
            body = {"model": MODEL, "prompt": "a b c", "max_tokens": 2, "stream": True}
            resp = httpx.post(
                f"{router.url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
            )
        # leaving the router flushed its spans to the collector
    assert resp.status_code == 200
    legs = [r for r in p.state.generation_requests() + d.state.generation_requests()]
    legs = [r for r in legs if r.body["prompt"] == "a b c"]
    assert len(legs) == 2
    for leg in legs:
        _, trace_id, span_id, _ = leg.headers["traceparent"].split("-")
        assert trace_id == TRACE_ID and span_id != "00f067aa0ba902b7"
    with lock:
        ours = {name for name, trace in spans if trace == TRACE_ID}
    assert {"POST /v1/completions", "prefill", "decode", "first_token"} <= ours


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = (
        "import sys, asyncio\n"
        "from disagg_router.router.http.app import create_app\n"
        "from disagg_router.router.config import settings_from_mapping\n"
        "s = settings_from_mapping({'models': ['m'], 'prefill': {'instances': [{'url': "
        "'http://127.0.0.1:9'}]}, 'decode': {'instances': [{'url': 'http://127.0.0.1:9'}]}})\n"
        "app = create_app(s)\n"
        "async def main():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
