"""The fake vLLM OpenAI app: vLLM-shaped answers in P/D mode, failure injection, recording.

Who uses it: :class:`devstack.fakes.server.FakeVllmServer` (and ``python -m
devstack.fake_vllm``). A request whose ``kv_transfer_params`` has ``do_remote_decode`` is
answered like a prefill instance (one token plus vLLM's ``kv_transfer_params``, with the
state's engine shape when set); a bare identity probe with that shape alone, like our
connector (D's identity probe); one with ``do_remote_prefill`` like a decode instance (waits for
its P through a shared :class:`KvFabric` when one is set; counts the prompt as cached). Token
timings follow the behaviour's delays or its :class:`~devstack.fakes.state.TokenScript` s (known
timings for the bench client's tests); zero delays mean no sleeping or polling at all, so the
bench can measure router overhead against it. A body vLLM would reject gets an OpenAI-style 400
naming the field. The
routes beside generation (``/tokenize``, pooling, scoring, ``/v1/responses``) are
:mod:`devstack.fakes.routes`'; ``/v1/models`` reports ``max_model_len`` as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from devstack.fakes.bodies import whole_answer
from devstack.fakes.routes import add_passthrough_routes
from devstack.fakes.state import FakeVllmState, RecordedRequest
from disagg_router.connector.contract import (
    IDENTITY_PROBE_KEY,
    KV_TRANSFER_PARAMS,
    REMOTE_PREFILL_CACHED_TOKENS,
    engine_shape_params,
    is_decode_leg,
    is_identity_probe,
    prefill_answer_params,
    read_decode_leg,
    read_prefill_leg,
    with_engine_suffix,
)
from disagg_router.connector.errors import ContractError
from disagg_router.router.upstream.sse import DONE, encode_data

_POLL_S = 0.005
_HANG_CAP_S = 600.0


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            return len(prompt) if all(isinstance(t, int) for t in prompt) else len(prompt) * 4
        text = str(prompt)
    return max(1, len(text.split()))


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int):
            return value
    return default


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in OpenAI form (vLLM names the offending field in ``param`` on a 400)."""
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}},
        status_code=status,
    )


def _invalid_field(body: Any) -> tuple[str, str] | None:
    """(message, field) of the first field vLLM would reject with a 400, or ``None``."""
    if not isinstance(body, dict):
        return "body must be a JSON object", "body"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{key} must be a positive integer", key
        if isinstance(value, int) and value < 1:
            return f"{key} must be a positive integer", key
    return None


async def _sleep_or_disconnect(request: Request, seconds: float) -> bool:
    """Sleep ``seconds``; return True early if the client disconnected meanwhile."""
    if seconds <= 0:
        return False
    deadline = time.monotonic() + seconds
    while True:
        if await request.is_disconnected():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(_POLL_S, left))


FAKE_TOKEN_ID = 1000
"""The id of a fake's ``i``-th generated token is this plus ``i``."""


class _Generation:
    """One generation request: builds vLLM-shaped payloads for it."""

    def __init__(self, state: FakeVllmState, body: dict[str, Any], chat: bool, rid: str) -> None:
        self.state = state
        self.body = body
        self.chat = chat
        self.created = int(time.time())
        self.id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
        self.internal_id = self.id if chat else f"{self.id}-0"
        kv = body.get(KV_TRANSFER_PARAMS)
        self.kv_in: dict[str, Any] | None = kv if isinstance(kv, dict) else None
        self.p_leg = read_prefill_leg(self.kv_in)
        self.is_prefill = self.p_leg is not None
        self.is_remote_decode = is_decode_leg(self.kv_in)
        self.script = state.next_script()
        self.prompt_tokens = _prompt_tokens(body)
        self.n_tokens = _max_tokens(body, state.behavior.default_max_tokens)
        if self.is_prefill:
            self.n_tokens = min(self.n_tokens, 1)
        self.object = "chat.completion" if chat else "text_completion"

    def is_real_leg(self) -> bool:
        """A P or D leg of a dispatch (not an identity probe, not a plain completion)."""
        if self.kv_in is None or self.kv_in.get(IDENTITY_PROBE_KEY):
            return False
        return self.is_prefill or self.is_remote_decode

    def token(self, i: int) -> str:
        return f" tok{i}"

    def prefill_delay(self) -> float:
        """Seconds before the first token (the script's TTFT, else ``prefill_delay_s``)."""
        return self.state.behavior.prefill_delay_s if self.script is None else self.script.ttft_s

    def delay_before(self, i: int) -> float:
        """Seconds between token ``i - 1`` (or the prefill) and token ``i``."""
        if self.script is None:
            return self.state.behavior.token_delay_s
        return 0.0 if i == 0 else self.script.gap(i - 1)

    def cached_tokens(self) -> int:
        if self.is_remote_decode:
            return self.prompt_tokens  # D counts transferred blocks as prefix-cache hits
        return min(self.state.behavior.prompt_cached_tokens, self.prompt_tokens)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.state.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens()}
        return usage

    def kv_out(self) -> dict[str, Any] | None:
        shape = self.state.shape
        if not self.state.kv_connector:
            return None
        if self.p_leg is None:
            bare_probe = is_identity_probe(self.kv_in) and not self.is_remote_decode
            return engine_shape_params(shape) if bare_probe and shape is not None else None
        ident = self.state.identity
        params = prefill_answer_params(
            engine_id=ident.engine_id,
            host=ident.host,
            port=ident.port,
            request_id=with_engine_suffix(self.internal_id),
            block_ids=[[1]],
            num_tokens=self.prompt_tokens,
            transfer_mode=self.state.transfer_mode,
            tp_size=ident.tp_size,
            pp_size=ident.pp_size,
            transfer_id=self.p_leg.transfer_id,
        )
        params["dcp_size"] = 1
        params[REMOTE_PREFILL_CACHED_TOKENS] = self.cached_tokens()
        if shape is not None:
            params.update(engine_shape_params(shape))
        return params

    def full_response(self) -> dict[str, Any]:
        return whole_answer(
            answer_id=self.id,
            chat=self.chat,
            model=self.state.model,
            text="".join(self.token(i) for i in range(self.n_tokens)),
            usage=self.usage(self.n_tokens),
            kv_transfer_params=self.kv_out(),
            created=self.created,
        )

    def chunk(
        self, delta_text: str | None, finish: str | None, first: bool, index: int | None = None
    ) -> dict[str, Any]:
        """One stream chunk; ``index``: the token it carries (its id goes out with vLLM's
        ``return_token_ids``, and the first chunk carries the prompt's ids as vLLM places
        them: a chat's on the chunk, a completion's on its choice)."""
        choice: dict[str, Any] = {"index": 0}  # the keys in vLLM 0.32's order
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": None}
        out = {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.state.model,
            "choices": [choice],
        }
        if self.body.get("return_token_ids") is True:
            prompt = list(range(1, self.prompt_tokens + 1)) if first else None
            if self.chat and prompt is not None:
                out["prompt_token_ids"] = prompt
            elif not self.chat:
                choice["prompt_token_ids"] = prompt
            choice["token_ids"] = [] if index is None else [FAKE_TOKEN_ID + index]
        return out


def _sse(payload: dict[str, Any]) -> bytes:
    return encode_data(json.dumps(payload, separators=(",", ":")))


class _DroppedStream(Exception):
    """Raised inside the SSE body to make uvicorn abort the connection mid-stream."""


def create_fake_app(state: FakeVllmState) -> FastAPI:
    """Build the fake's ASGI app around ``state`` (which tests keep to inspect and steer)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        state.count_health_check()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model,
                    "object": "model",
                    "owned_by": "vllm",
                    "root": "fake",
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{state.model}"}} '
            f"{float(state.in_flight - state.waiting)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{state.model}"}} {float(state.waiting)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def generate(request: Request, chat: bool) -> Response:
        rec, body = await _record(state, request)
        problem = _invalid_field(body)
        if problem is not None:
            rec.outcome = "error"
            return _error(400, *problem)
        state._enter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        gen = _Generation(state, body, chat, rid)
        try:
            failed = await _before_first_token(state, gen, request, rid)
        except asyncio.CancelledError:
            state._leave(rec, "cancelled")
            raise
        if failed is not None:
            outcome, response = failed
            state._leave(rec, outcome)
            return response
        if body.get("stream"):
            b = state.behavior
            drop_at, stall_at = b.drop_after_tokens, b.stall_after_tokens
            if (drop_at is not None or stall_at is not None) and not state._take_failure():
                drop_at = stall_at = None
            return StreamingResponse(
                _stream(state, gen, rec, drop_at, stall_at),
                media_type="text/event-stream",
                headers={"x-request-id": rid},
            )
        return await _answer(state, gen, rec, request, rid)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    add_passthrough_routes(app, state, _record)
    return app


async def _record(state: FakeVllmState, request: Request) -> tuple[RecordedRequest, Any]:
    """Record the request as received; its body parsed (the raw text when not JSON)."""
    raw = await request.body()
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    rec = RecordedRequest(
        method=request.method,
        path=request.url.path,
        headers={k.lower(): v for k, v in request.headers.items()},
        body=body,
        received_at=time.monotonic(),
        client_port=request.client.port if request.client else None,
    )
    state.record(rec)
    return rec, body


async def _prefill(state: FakeVllmState, gen: _Generation, request: Request) -> bool:
    """The prefill delay, queued for one of ``prefill_slots`` when set; True if the client left."""
    slots = state.behavior.prefill_slots
    if not slots or not gen.prefill_delay():
        return await _sleep_or_disconnect(request, gen.prefill_delay())
    gate = state.prefill_gate(slots)
    state.queued(+1)
    try:
        await gate.acquire()
    finally:
        state.queued(-1)
    try:
        return await _sleep_or_disconnect(request, gen.prefill_delay())
    finally:
        gate.release()


async def _before_first_token(
    state: FakeVllmState, gen: _Generation, request: Request, rid: str
) -> tuple[str, Response] | None:
    """Injected failures, the prefill delay and (D) the wait for P's KV; ``None`` when the
    request goes on to its tokens, else the outcome to record and the error to answer."""
    b = state.behavior
    if b.leg_fail_status is not None and gen.is_real_leg():
        return "error", _error(b.leg_fail_status, "injected leg failure")
    failing = (b.fail_status is not None or b.hang) and state._take_failure()
    if failing and b.hang:
        gone = await _sleep_or_disconnect(request, _HANG_CAP_S)
        return ("cancelled" if gone else "error"), _error(500, "hang cap reached")
    if failing and b.fail_status is not None:
        return "error", _error(b.fail_status, "injected failure")
    if await _prefill(state, gen, request):
        return "cancelled", _error(499, "client disconnected")
    kv_wait = await _wait_for_remote_kv(state, gen, request, rid)
    if kv_wait is not None:
        outcome = "cancelled" if kv_wait == "cancelled" else "error"
        return outcome, _error(500, f"KV transfer failed: {kv_wait}")
    return None


async def _answer(
    state: FakeVllmState, gen: _Generation, rec: RecordedRequest, request: Request, rid: str
) -> Response:
    """The non-streamed answer, after every token's delay (P publishes its KV first)."""
    for i in range(gen.n_tokens):
        if await _sleep_or_disconnect(request, gen.delay_before(i)):
            state._leave(rec, "cancelled")
            return _error(499, "client disconnected")
    if gen.is_prefill and state.fabric is not None:
        state.fabric.publish(state.identity.engine_id, rid)
    if await _sleep_or_disconnect(request, state.behavior.answer_delay_s):
        state._leave(rec, "cancelled")
        return _error(499, "client disconnected")
    state._leave(rec, "ok")
    return JSONResponse(gen.full_response(), headers={"x-request-id": rid})


async def _wait_for_remote_kv(
    state: FakeVllmState, gen: _Generation, request: Request, rid: str
) -> str | None:
    """D side: wait for the paired P's prefill; None when the KV is there (or no fabric)."""
    if state.fabric is None:
        return None
    try:
        leg = read_decode_leg(gen.kv_in)
    except ContractError:  # like our connector: P's identity incomplete, prefill locally
        return None
    if leg is None:
        return None
    engine_id = leg.peer.engine_id
    deadline = time.monotonic() + state.behavior.kv_wait_timeout_s
    while not state.fabric.is_done(engine_id, rid):
        if time.monotonic() > deadline:
            return f"no push from engine {engine_id} for {rid}"
        if await _sleep_or_disconnect(request, 0.002):
            return "cancelled"
    return None


async def _stream(
    state: FakeVllmState,
    gen: _Generation,
    rec: RecordedRequest,
    drop_at: int | None,
    stall_at: int | None = None,
) -> AsyncIterator[bytes]:
    """SSE body like vLLM's: (chat: role chunk), token chunks, finish chunk, usage, [DONE].

    Tokens go out on an absolute schedule (delays do not accumulate sleep overshoot); each one's
    send time is recorded in ``rec.token_times``. ``drop_at``: abort the connection before that
    token; ``stall_at``: send nothing from that token on (until cancelled or the hang cap).
    """
    outcome = "cancelled"
    try:
        first = True
        if gen.chat:
            yield _sse(gen.chunk("", None, first=True))
            first = False
        due = time.perf_counter()
        for i in range(gen.n_tokens):
            due += gen.delay_before(i)
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if drop_at is not None and i >= drop_at:
                outcome = "dropped"
                raise _DroppedStream
            if stall_at is not None and i >= stall_at:
                await asyncio.sleep(_HANG_CAP_S)  # cancelled when the client leaves
                outcome = "error"
                return
            last = i == gen.n_tokens - 1
            rec.token_times.append(time.perf_counter())
            yield _sse(gen.chunk(gen.token(i), "length" if last else None, first=first, index=i))
            first = False
        opts = gen.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage_chunk = gen.chunk(None, None, first=False)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = gen.usage(gen.n_tokens)
            yield _sse(usage_chunk)
        yield encode_data(DONE)
        outcome = "ok"
    finally:
        state._leave(rec, outcome)
