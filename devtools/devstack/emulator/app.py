"""The HTTP face of one emulated engine: what vLLM's OpenAI server answers, in P/D mode.

Who uses it: :class:`devstack.emulator.fleet.Fleet` serves one app per engine. Routes:
``/v1/completions`` and ``/v1/chat/completions`` (SSE stream and JSON, ``stream_options``
usage, ``return_token_ids``), ``/health``, ``/v1/models``, ``/tokenize``, and ``/metrics`` with
vLLM's metric names and our connector's hand-over figures (``disagg_push_*``). A request with
``kv_transfer_params`` is a P leg (``do_remote_decode``: one token, its blocks held for D, P's
identity and blocks in the answer) or a D leg
(``do_remote_prefill``: its KV comes from the P it names, through the engine's fabric; a P
unknown to the fabric means a local prefill, like a connector that cannot reach its peer).
Identity probes are answered at once with no work. A body vLLM would refuse gets its 400
naming the field; a prompt longer than the model allows too. A client that leaves aborts its
request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from devstack.emulator.engine import KILLED, Engine, Outlet
from devstack.emulator.scheduler import GENERATED_TOKEN_ID, Role, Seq
from devstack.emulator.tokens import Tokens
from devstack.fakes.bodies import whole_answer
from disagg_router.connector.contract import (
    KV_TRANSFER_PARAMS,
    REMOTE_PREFILL_CACHED_TOKENS,
    is_identity_probe,
    prefill_answer_params,
    read_decode_leg,
    read_prefill_leg,
    with_engine_suffix,
)
from disagg_router.connector.errors import ContractError
from disagg_router.router.upstream.sse import DONE, encode_data

DEFAULT_MAX_TOKENS = 16


class _Killed(Exception):
    """Raised in a handler of a killed engine: the server drops the connection, as a dead
    process's would be."""


@dataclass(frozen=True)
class Identity:
    """How an engine names itself in P's answers, and the transfer mode it reports."""

    engine_id: str
    host: str
    port: int
    transfer_mode: str = "push"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _max_tokens(body: Mapping[str, Any]) -> int | tuple[str, str]:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{key} must be a positive integer", key
        return value
    return DEFAULT_MAX_TOKENS


@dataclass
class _Leg:
    """One generation request as the app sees it."""

    body: dict[str, Any]
    chat: bool
    rid: str
    seq: Seq
    kv_in: dict[str, Any] | None

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.rid}" if self.chat else f"cmpl-{self.rid}"


def create_app(engine: Engine, identity: Identity, tokens: Tokens) -> FastAPI:
    """The app of ``engine``; ``tokens`` turns request bodies into token ids."""
    app = FastAPI()
    model = engine.profile.model
    max_len = engine.profile.max_model_len

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "owned_by": "vllm", "max_model_len": max_len}
        return {"object": "list", "data": [{**card, "root": model}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(engine))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        ids = tokens.of(body, chat="messages" in body)
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def generate(request: Request, chat: bool) -> Response:
        if engine.dead:
            raise _Killed
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body must be JSON", "body")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object", "body")
        if body.get("model") not in (None, model):
            return _error(404, f"The model `{body.get('model')}` does not exist.", "model")
        leg = _make_leg(engine, tokens, body, chat, request.headers.get("x-request-id"))
        if isinstance(leg, JSONResponse):
            return leg
        headers = {"x-request-id": leg.rid}
        if is_identity_probe(leg.kv_in):
            return JSONResponse(_full(leg, identity, model, 1), headers=headers)
        outlet = engine.submit(leg.seq)
        if body.get("stream"):
            stream = _stream(engine, leg, outlet, identity, model)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return await _answer(engine, leg, outlet, identity, model, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


def _make_leg(
    engine: Engine, tokens: Tokens, body: dict[str, Any], chat: bool, rid: str | None
) -> _Leg | JSONResponse:
    """The request's sequence with its role and hand-over key, or the 400 vLLM would answer."""
    if chat and not isinstance(body.get("messages"), list):
        return _error(400, "messages must be a list", "messages")
    limit = _max_tokens(body)
    if isinstance(limit, tuple):
        return _error(400, *limit)
    ids = tokens.of(body, chat)
    if len(ids) + limit > engine.profile.max_model_len:
        message = f"prompt ({len(ids)} tokens) plus max_tokens exceeds the model's length"
        return _error(400, message, "messages" if chat else "prompt")
    kv = body.get(KV_TRANSFER_PARAMS)
    kv_in = kv if isinstance(kv, dict) else None
    rid = rid or uuid.uuid4().hex
    role, key = _role(engine, kv_in, rid)
    seq = Seq(rid=rid, tokens=list(ids), max_tokens=1 if role == "prefill" else limit, role=role)
    if key is not None and not is_identity_probe(kv_in):  # a probe is answered, never run
        engine.fabric.expect(seq, key)
    return _Leg(body, chat, rid, seq, kv_in)


def _role(engine: Engine, kv_in: dict[str, Any] | None, rid: str) -> tuple[Role, str | None]:
    """The request's role here and the key its KV is handed over under."""
    p_leg = read_prefill_leg(kv_in)
    if p_leg is not None:
        return "prefill", p_leg.transfer_id or rid
    try:
        d_leg = read_decode_leg(kv_in)
    except ContractError:  # P's identity incomplete: prefill locally, as our connector does
        return "local", None
    if d_leg is None or not engine.fabric.knows(d_leg.peer.engine_id):
        return "local", None
    return "decode", d_leg.transfer_id or rid


def _kv_out(leg: _Leg, identity: Identity) -> dict[str, Any] | None:
    if leg.seq.role != "prefill":
        return None
    params = prefill_answer_params(
        engine_id=identity.engine_id,
        host=identity.host,
        port=identity.port,
        request_id=with_engine_suffix(leg.id if leg.chat else f"{leg.id}-0"),
        block_ids=list(leg.seq.blocks),
        num_tokens=leg.seq.prompt_len,
        transfer_mode=identity.transfer_mode,
        transfer_id=(leg.kv_in or {}).get("transfer_id"),
    )
    params[REMOTE_PREFILL_CACHED_TOKENS] = leg.seq.prefix_hit_tokens
    return params


def _usage(leg: _Leg, completion: int) -> dict[str, Any]:
    prompt = leg.seq.prompt_len
    cached = prompt if leg.seq.kv_loaded else leg.seq.prefix_hit_tokens
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _text(i: int) -> str:
    return f" tok{i}"


def _full(leg: _Leg, identity: Identity, model: str, n: int) -> dict[str, Any]:
    return whole_answer(
        answer_id=leg.id,
        chat=leg.chat,
        model=model,
        text="".join(_text(i) for i in range(n)),
        usage=_usage(leg, n),
        kv_transfer_params=_kv_out(leg, identity),
    )


async def _answer(
    engine: Engine,
    leg: _Leg,
    outlet: Outlet,
    identity: Identity,
    model: str,
    request: Request,
) -> Response:
    """The JSON answer when the request ends; the request is aborted if the client leaves."""
    ended = asyncio.ensure_future(_drain(outlet))
    gone = asyncio.ensure_future(request.receive())  # the body is read: only a disconnect comes
    try:
        await asyncio.wait({ended, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not ended.done():
        ended.cancel()
        engine.abort(leg.seq)
        return _error(499, "client disconnected")
    if outlet.error == KILLED:
        raise _Killed
    if outlet.error is not None:
        return _error(500, f"KV transfer failed: {outlet.error}")
    await engine.sleep(engine.profile.answer_overhead_s)
    headers = {"x-request-id": leg.rid}
    return JSONResponse(_full(leg, identity, model, ended.result()), headers=headers)


async def _drain(outlet: Outlet) -> int:
    n = 0
    while await outlet.queue.get() is not None:
        n += 1
    return n


def _sse(payload: dict[str, Any]) -> bytes:
    return encode_data(json.dumps(payload, separators=(",", ":")))


def _chunk(
    leg: _Leg, model: str, text: str | None, index: int | None, last: bool, first: bool
) -> bytes:
    """One stream chunk carrying the token ``index`` (None: a chat's role chunk); with
    ``return_token_ids`` its token's id, and on the ``first`` chunk the prompt's ids where vLLM
    puts them (a chat's on the chunk, a completion's on its choice)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    if leg.chat:
        delta: dict[str, Any] = {} if index is not None else {"role": "assistant"}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if last:
        choice["finish_reason"] = "length"
    choice["stop_reason"] = None
    out: dict[str, Any] = {
        "id": leg.id,
        "object": "chat.completion.chunk" if leg.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if leg.body.get("return_token_ids") is True:
        choice["token_ids"] = [] if index is None else [GENERATED_TOKEN_ID + index]
        prompt = leg.seq.tokens[: leg.seq.prompt_len] if first else None
        if leg.chat and prompt is not None:
            out["prompt_token_ids"] = prompt
        elif not leg.chat:
            choice["prompt_token_ids"] = prompt
    return _sse(out)


async def _stream(
    engine: Engine, leg: _Leg, outlet: Outlet, identity: Identity, model: str
) -> AsyncIterator[bytes]:
    """vLLM's SSE body: (chat: a role chunk), a chunk per token (the last one finishing),
    usage when asked, ``[DONE]``; an error ends it with an error event, as vLLM's does."""
    done = False
    try:
        if leg.chat:
            yield _chunk(leg, model, "", None, last=False, first=True)
        n = 0
        while (index := await outlet.queue.get()) is not None:
            n += 1
            last = n == leg.seq.max_tokens
            yield _chunk(leg, model, _text(index), index, last, first=n == 1 and not leg.chat)
        done = True
        if outlet.error == KILLED:
            raise _Killed
        if outlet.error is not None:
            yield _sse({"error": {"message": outlet.error, "type": "InternalServerError"}})
            return
        opts = leg.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage = {"id": leg.id, "object": "chat.completion.chunk", "model": model}
            yield _sse({**usage, "choices": [], "usage": _usage(leg, n)})
        yield encode_data(DONE)
    finally:
        if not done:
            engine.abort(leg.seq)


def metrics_text(engine: Engine) -> str:
    """``/metrics``: vLLM's names for the figures a router reads (and a few it may)."""
    sched, pool, c = engine.scheduler, engine.pool, engine.counters
    label = f'{{model_name="{engine.profile.model}"}}'
    waiting = len(sched.waiting) + len(sched.awaiting_kv)  # vLLM counts those as waiting
    rows = [
        ("gauge", "vllm:num_requests_running", len(sched.running)),
        ("gauge", "vllm:num_requests_waiting", waiting),
        ("gauge", "vllm:kv_cache_usage_perc", pool.usage),
        ("counter", "vllm:prefix_cache_queries_total", pool.queries),
        ("counter", "vllm:prefix_cache_hits_total", pool.hits),
        ("counter", "vllm:prompt_tokens_total", c.prompt_tokens),
        ("counter", "vllm:generation_tokens_total", c.generation_tokens),
        ("counter", "vllm:request_success_total", c.success),
        ("counter", "vllm:num_preemptions_total", sched.preemptions),
    ]
    h = engine.handovers
    rows += [
        ("counter", "disagg_push_transfers_total", h.transfers),
        ("counter", "disagg_push_unwritten_block_seconds_total", h.unwritten_block_s),
    ]
    lines = []
    for kind, name, value in rows:
        lines += [f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
    # vLLM's info gauge of the cache config: the KV cache's size as a router reads it
    config = f'block_size="{pool.block_size}",num_gpu_blocks="{pool.num_blocks}"'
    lines += ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{config}}} 1.0"]
    return "\n".join(lines) + "\n" + generate_latest(h.registry).decode()
