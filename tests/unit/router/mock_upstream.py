"""A P/D pair of vLLM instances scripted by one handler (:mod:`tests.support.scripted`), for app
tests that script upstream answers: P's ``kv_transfer_params``, vLLM-shaped answers, the pair's
servers (:func:`pair`); and one request made of an app as the server would make it
(:func:`asgi_messages`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from tests.support.scripted import Handler, scripted

KV = {
    "do_remote_prefill": True,
    "remote_engine_id": "eng",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "pp_size": 1,
    "remote_request_id": "cmpl-x-0-12345678",
    "remote_block_ids": [[1]],
}


@contextmanager
def pair(handler: Handler) -> Iterator[tuple[str, str]]:
    """The URLs of a P and a D server both answering with ``handler``, stopped on exit."""
    with scripted(handler, 2) as (p, d):
        yield p.url, d.url


def answer(text: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """A non-streamed completions answer with ``kv`` as its ``kv_transfer_params``."""
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "kv_transfer_params": kv,
    }


class Upstream:
    """Answers like vLLM P and D (health, JSON, SSE); counts generation requests (not probes).
    A streamed answer carries ``tokens`` events, all in one body (and, with
    ``stream_options.include_usage``, a last event with the usage, as vLLM sends it)."""

    def __init__(self, tokens: int = 1) -> None:
        self.generations = 0
        self.tokens = tokens

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # health checks, /v1/models, /metrics
            return httpx.Response(200 if request.url.path == "/health" else 404)
        body = json.loads(request.content)
        if not body["kv_transfer_params"].get("identity_probe"):
            self.generations += 1
        if body.get("stream"):
            chunk = {"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            sse = f"data: {json.dumps(chunk)}\n\n" * self.tokens
            if (body.get("stream_options") or {}).get("include_usage"):  # vLLM's last chunk
                usage = {"prompt_tokens": 3, "completion_tokens": self.tokens}
                sse += f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            sse += "data: [DONE]\n\n"
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=answer("a", KV))


async def asgi_messages(
    app: FastAPI,
    body: dict[str, Any],
    on_message: Callable[[MutableMapping[str, Any]], None] | None = None,
) -> list[MutableMapping[str, Any]]:
    """What ``app`` sends the server for one request of ``body`` to ``/v1/completions`` (each
    ASGI message is one write to the client's connection), the client staying connected;
    ``on_message`` sees each message as it is sent."""
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    messages: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        messages.append(message)
        if on_message is not None:
            on_message(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    async with app.router.lifespan_context(app):
        await app.state.runtime.lifecycle.initial_check_done.wait()
        await app(scope, receive, send)
    return messages
