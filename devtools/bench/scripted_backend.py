"""A fake OpenAI streaming server that emits tokens at scripted times (a real loopback server).

Who uses it: the bench unit tests (known token timings, to check the client's metrics) and the
router-overhead benchmark (zero delays, as the backend behind the router and behind vLLM-router).
It behaves like vLLM's ``/v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` chunks
(``ignore_eos`` semantics), a final usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``. Non-streamed requests (a router's prefill leg) get one JSON completion that
echoes ``kv_transfer_params`` with the fields vLLM's NIXL connectors return, so P/D routers
accept it. Bad input gets an OpenAI-style 400 naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class TokenScript:
    """Delays of one response: ``ttft_s`` before the first token, then ``gaps_s[i]`` before token
    ``i + 1`` (the last gap repeats if the response is longer than the script)."""

    ttft_s: float = 0.0
    gaps_s: tuple[float, ...] = ()

    def gap(self, index: int) -> float:
        if not self.gaps_s:
            return 0.0
        return self.gaps_s[min(index, len(self.gaps_s) - 1)]


@dataclass
class BackendLog:
    """What the backend did, for tests: request bodies and per-request token send times."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    send_times: list[list[float]] = field(default_factory=list)


def _error(message: str, param: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    return JSONResponse(body, status_code=400)


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages") or []
    return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))


def _chunk(chat: bool, index: int, last: bool) -> dict[str, Any]:
    text = f" t{index}"
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": "scripted",
        "object": kind,
        "created": 0,
        "model": "scripted",
        "choices": [choice],
    }


def create_scripted_app(scripts: Sequence[TokenScript], log: BackendLog | None = None) -> Starlette:
    """An app answering request ``k`` with ``scripts[k % len(scripts)]``."""
    if not scripts:
        raise ValueError("scripts must not be empty")
    counter = itertools.count()
    record = log if log is not None else BackendLog()

    async def complete(request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("body is not valid JSON", "body")
        if not isinstance(body, dict):
            return _error("body must be a JSON object", "body")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error("max_tokens must be a positive integer", "max_tokens")
        chat = request.url.path.endswith("/chat/completions")
        script = scripts[next(counter) % len(scripts)]
        record.bodies.append(body)
        if not body.get("stream"):
            await asyncio.sleep(script.ttft_s)
            return JSONResponse(_final_json(body, chat, max_tokens))
        times: list[float] = []
        record.send_times.append(times)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _stream(script, chat, max_tokens, _prompt_tokens(body), include_usage, times),
            media_type="text/event-stream",
        )

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    return Starlette(
        routes=[
            Route("/v1/completions", complete, methods=["POST"]),
            Route("/v1/chat/completions", complete, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def _final_json(body: dict[str, Any], chat: bool, max_tokens: int) -> dict[str, Any]:
    text = "".join(f" t{i}" for i in range(max_tokens))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    prompt_tokens = _prompt_tokens(body)
    params = body.get("kv_transfer_params") or {}
    out: dict[str, Any] = {
        "id": "scripted",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": "scripted",
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        },
    }
    if isinstance(params, dict) and params:
        out["kv_transfer_params"] = {
            **params,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0],
            "remote_engine_id": "scripted-engine",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "tp_size": 1,
        }
    return out


async def _stream(
    script: TokenScript,
    chat: bool,
    max_tokens: int,
    prompt_tokens: int,
    include_usage: bool,
    times: list[float],
) -> AsyncIterator[bytes]:
    start = time.perf_counter()
    due = start + script.ttft_s
    for i in range(max_tokens):
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        times.append(time.perf_counter())
        yield f"data: {json.dumps(_chunk(chat, i, i == max_tokens - 1))}\n\n".encode()
        due += script.gap(i)
    if include_usage:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
        }
        tail = {"id": "scripted", "object": "text_completion", "choices": [], "usage": usage}
        yield f"data: {json.dumps(tail)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def bind_loopback(port: int = 0) -> socket.socket:
    """A bound, listening loopback socket (port 0 picks a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def make_server(app: Starlette) -> uvicorn.Server:
    """A quiet uvicorn server for ``app``; start it with ``server.serve(sockets=[sock])``."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    return uvicorn.Server(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a fixed-delay backend as a process (``python -m bench.scripted_backend``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    args = parser.parse_args(argv)
    app = create_scripted_app([TokenScript(args.ttft, (args.itl,))])
    sock = bind_loopback(args.port)
    asyncio.run(make_server(app).serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
