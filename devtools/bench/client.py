"""One streamed OpenAI request, timed like ``vllm bench serve``.

Who calls it: :mod:`bench.loadgen`, once per request, with the run's single long-lived
``httpx.AsyncClient``. It never raises for a failed request: transport errors, non-200 statuses,
error events and streams without a token all come back as ``RequestRecord(success=False)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from httpx_sse import SSEError

from bench.dataset import BenchRequest
from bench.metrics import RequestRecord
from devstack.sse_client import aiter_data
from disagg_router.router.upstream.sse import StreamEndedEarly

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    extra_body: tuple[tuple[str, Any], ...] = ()
    #: Named ``/metrics`` URLs whose histograms a sweep point breaks TTFT down with
    #: (:mod:`bench.breakdown`): e.g. ``(("router", url), ("prefill", url), ("decode", url))``.
    metrics: tuple[tuple[str, str], ...] = ()
    #: Request headers sent with every request (e.g. a tenant's ``Authorization``).
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


def build_payload(target: Target, request: BenchRequest) -> dict[str, Any]:
    """The JSON body for ``request``: streamed, usage included, exact output length."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint == "completions":
        body["prompt"] = (
            list(request.prompt) if isinstance(request.prompt, tuple) else request.prompt
        )
    else:
        if not isinstance(request.prompt, str):
            raise ValueError("endpoint: chat needs text prompts (use --prompt-format text)")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    body.update(dict(target.extra_body))
    return body


def _has_choice(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return isinstance(choices, list) and len(choices) > 0


async def send_request(
    client: httpx.AsyncClient, target: Target, request: BenchRequest
) -> RequestRecord:
    """Send ``request`` and time its stream. Closes the stream on every path."""
    payload = build_payload(target, request)
    start = time.perf_counter()
    ttft = 0.0
    last = start
    itl: list[float] = []
    chunks = 0
    usage_tokens: int | None = None
    prompt_len = request.prompt_len
    rid = ""

    def failed(error: str) -> RequestRecord:
        elapsed = last - start
        return RequestRecord(False, prompt_len, 0, start, ttft, elapsed, tuple(itl), error, rid)

    try:
        url, headers = target.base_url + target.path, dict(target.headers)
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            rid = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")[:500]
                return failed(f"HTTP {resp.status_code}: {body}")
            async for data in aiter_data(resp):
                event = json.loads(data)
                if "error" in event:
                    return failed(f"error event: {json.dumps(event['error'])[:500]}")
                if _has_choice(event):
                    now = time.perf_counter()
                    if chunks == 0:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if isinstance(usage, dict):
                    if isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        prompt_len = usage["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, SSEError, StreamEndedEarly) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    if chunks == 0:
        return failed("stream ended without a token")
    output_tokens = usage_tokens if usage_tokens is not None else chunks
    elapsed = last - start
    return RequestRecord(True, prompt_len, output_tokens, start, ttft, elapsed, tuple(itl), "", rid)
