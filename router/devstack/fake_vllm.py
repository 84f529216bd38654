"""A fake vLLM OpenAI server that behaves, as far as the router can see, like vLLM in P/D mode.

Who uses it: the router's integration tests and the bench (router-overhead runs with zero delays).
It serves ``/v1/completions`` and ``/v1/chat/completions`` (SSE stream and JSON), ``/v1/models``,
``/health`` and ``/metrics`` (running/waiting gauges named like vLLM's). A request carrying
``kv_transfer_params.do_remote_decode`` is answered like a prefill instance: one token and the
``kv_transfer_params`` vLLM's NIXL connectors return (engine id, side channel, tp/pp size, ...).

Every request is recorded (path, headers, body, outcome) so tests can assert exact wire traffic,
and in-flight / cancelled counts prove that the router cancels upstream legs. Behaviour knobs
(``FakeBehavior``) are plain mutable fields that tests may change while the server runs.

It must not do real inference, reach anything but loopback, or keep threads after ``stop()``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

_POLL_S = 0.005
_HANG_CAP_S = 600.0


@dataclass
class FakeBehavior:
    """Mutable knobs; tests change them between (or during) requests.

    ``fail_status``: answer every generation request with this HTTP error.
    ``hang``: never answer (until the client goes away or the cap passes).
    ``drop_after_tokens``: in a stream, cut the connection after this many tokens.
    ``fail_times``: only the next N generation requests fail/hang/drop (None: all of them).
    """

    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fail_status: int | None = None
    hang: bool = False
    drop_after_tokens: int | None = None
    fail_times: int | None = None
    default_max_tokens: int = 16
    prompt_cached_tokens: int = 0
    kv_wait_timeout_s: float = 5.0


@dataclass
class PushIdentity:
    """What a prefill instance reports about itself in ``kv_transfer_params``."""

    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = "127.0.0.1"
    port: int = 5600
    tp_size: int = 1
    pp_size: int = 1


class KvFabric:
    """Links fakes the way NIXL push links P and D, for tests that share one fabric.

    A prefill fake publishes ``(its engine id, X-Request-Id)`` when it finishes a
    ``do_remote_decode`` request; a decode fake given ``do_remote_prefill`` produces no token until
    the P named by ``remote_engine_id`` published the same request id (or its
    ``kv_wait_timeout_s`` passes: then it fails like vLLM's registration watchdog). So a wrongly
    paired D fails, and D's first token never precedes P's answer.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[tuple[str, str]] = set()

    def publish(self, engine_id: str, request_id: str) -> None:
        with self._lock:
            self._done.add((engine_id, request_id))

    def is_done(self, engine_id: str, request_id: str) -> bool:
        with self._lock:
            return (engine_id, request_id) in self._done


@dataclass
class RecordedRequest:
    """One request as the fake received it; ``outcome`` is filled when it ends."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    received_at: float
    finished_at: float | None = None
    outcome: str = "in_flight"  # ok | cancelled | error | dropped | in_flight


def identity_copy(identity: PushIdentity) -> PushIdentity:
    return PushIdentity(
        identity.engine_id, identity.host, identity.port, identity.tp_size, identity.pp_size
    )


class FakeVllmState:
    """Shared, thread-safe state of one fake instance (records, counters, behaviour)."""

    def __init__(
        self,
        model: str = "fake-model",
        behavior: FakeBehavior | None = None,
        identity: PushIdentity | None = None,
        transfer_mode: str = "push",
        fabric: KvFabric | None = None,
        kv_connector: bool = True,
        prompt_tokens_details: bool = True,
    ) -> None:
        self.model = model
        self.fabric = fabric
        self.kv_connector = kv_connector  # False: like vLLM started without --kv-transfer-config
        # False: like vLLM started without --enable-prompt-tokens-details
        self.prompt_tokens_details = prompt_tokens_details
        self.behavior = behavior or FakeBehavior()
        self.identity = identity or PushIdentity()
        self.transfer_mode = transfer_mode
        self._initial = (
            transfer_mode,
            kv_connector,
            prompt_tokens_details,
            identity_copy(self.identity),
        )
        self._lock = threading.Lock()
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.cancelled = 0
        self.completed = 0
        self._cond = threading.Condition(self._lock)

    def reset(self, behavior: FakeBehavior | None = None) -> None:
        """Forget records and counters; install ``behavior`` (default: a fresh one); restore the
        constructed transfer mode, connector flag and identity."""
        with self._lock:
            self.transfer_mode, self.kv_connector, self.prompt_tokens_details, identity = (
                self._initial
            )
            self.identity = identity_copy(identity)
            self.requests.clear()
            self.cancelled = 0
            self.completed = 0
            self.behavior = behavior or FakeBehavior()

    def record(self, rec: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(rec)

    def generation_requests(self) -> list[RecordedRequest]:
        """Recorded completion/chat requests (probes included), in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.path.startswith("/v1/") and r.method == "POST"]

    def _take_failure(self) -> bool:
        with self._lock:
            b = self.behavior
            if b.fail_times is None:
                return True
            if b.fail_times <= 0:
                return False
            b.fail_times -= 1
            return True

    def _enter(self) -> None:
        with self._cond:
            self.in_flight += 1
            self._cond.notify_all()

    def _leave(self, rec: RecordedRequest, outcome: str) -> None:
        with self._cond:
            self.in_flight -= 1
            rec.outcome = outcome
            rec.finished_at = time.monotonic()
            if outcome == "cancelled":
                self.cancelled += 1
            elif outcome == "ok":
                self.completed += 1
            self._cond.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 15.0) -> bool:
        """Block (test thread) until ``predicate(state)`` is true; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True


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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}},
        status_code=status,
    )


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


class _Generation:
    """One generation request: builds vLLM-shaped payloads for it."""

    def __init__(self, state: FakeVllmState, body: dict[str, Any], chat: bool, rid: str) -> None:
        self.state = state
        self.body = body
        self.chat = chat
        self.created = int(time.time())
        self.id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
        self.internal_id = self.id if chat else f"{self.id}-0"
        kv = body.get("kv_transfer_params")
        self.kv_in: dict[str, Any] | None = kv if isinstance(kv, dict) else None
        self.is_prefill = bool(self.kv_in and self.kv_in.get("do_remote_decode"))
        self.is_remote_decode = bool(self.kv_in and self.kv_in.get("do_remote_prefill"))
        self.prompt_tokens = _prompt_tokens(body)
        self.n_tokens = _max_tokens(body, state.behavior.default_max_tokens)
        if self.is_prefill:
            self.n_tokens = min(self.n_tokens, 1)
        self.object = "chat.completion" if chat else "text_completion"

    def token(self, i: int) -> str:
        return f" tok{i}"

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
        if not self.is_prefill or not self.state.kv_connector:
            return None
        ident = self.state.identity
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1]],
            "remote_engine_id": ident.engine_id,
            "remote_request_id": f"{self.internal_id}-{uuid.uuid4().hex[:8]}",
            "remote_host": ident.host,
            "remote_port": ident.port,
            "tp_size": ident.tp_size,
            "dcp_size": 1,
            "pp_size": ident.pp_size,
            "remote_num_tokens": self.prompt_tokens,
            "transfer_mode": self.state.transfer_mode,
            "remote_prefill_cached_tokens": self.cached_tokens(),
        }

    def full_response(self) -> dict[str, Any]:
        text = "".join(self.token(i) for i in range(self.n_tokens))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice["stop_reason"] = None
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.state.model,
            "choices": [choice],
            "usage": self.usage(self.n_tokens),
            "system_fingerprint": None,
            "kv_transfer_params": self.kv_out(),
        }

    def chunk(self, delta_text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice["delta"] = delta
        else:
            choice["text"] = delta_text or ""
        choice["stop_reason"] = None
        return {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.state.model,
            "choices": [choice],
        }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _DroppedStream(Exception):
    """Raised inside the SSE body to make uvicorn abort the connection mid-stream."""


def create_fake_app(state: FakeVllmState) -> FastAPI:
    """Build the fake's ASGI app around ``state`` (which tests keep to inspect and steer)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": state.model, "object": "model", "owned_by": "vllm", "root": "fake"}],
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{state.model}"}} {float(state.in_flight)}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{state.model}"}} 0.0',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def generate(request: Request, chat: bool) -> Response:
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
        )
        state.record(rec)
        if not isinstance(body, dict):
            rec.outcome = "error"
            return _error(400, "body must be a JSON object")
        state._enter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        gen = _Generation(state, body, chat, rid)
        b = state.behavior
        failing = (b.fail_status is not None or b.hang) and state._take_failure()
        try:
            if failing and b.hang:
                gone = await _sleep_or_disconnect(request, _HANG_CAP_S)
                state._leave(rec, "cancelled" if gone else "error")
                return _error(500, "hang cap reached")
            if failing and b.fail_status is not None:
                state._leave(rec, "error")
                return _error(b.fail_status, "injected failure")
            if await _sleep_or_disconnect(request, b.prefill_delay_s):
                state._leave(rec, "cancelled")
                return _error(499, "client disconnected")
            kv_wait = await _wait_for_remote_kv(state, gen, request, rid)
            if kv_wait is not None:
                state._leave(rec, "cancelled" if kv_wait == "cancelled" else "error")
                return _error(500, f"KV transfer failed: {kv_wait}")
        except asyncio.CancelledError:
            state._leave(rec, "cancelled")
            raise
        if body.get("stream"):
            drop_at = b.drop_after_tokens if b.drop_after_tokens is not None else None
            if drop_at is not None and not state._take_failure():
                drop_at = None
            return StreamingResponse(
                _stream(state, gen, rec, request, drop_at),
                media_type="text/event-stream",
                headers={"x-request-id": rid},
            )
        for _ in range(gen.n_tokens):
            if await _sleep_or_disconnect(request, b.token_delay_s):
                state._leave(rec, "cancelled")
                return _error(499, "client disconnected")
        if gen.is_prefill and state.fabric is not None:
            state.fabric.publish(state.identity.engine_id, rid)
        state._leave(rec, "ok")
        return JSONResponse(gen.full_response(), headers={"x-request-id": rid})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


async def _wait_for_remote_kv(
    state: FakeVllmState, gen: _Generation, request: Request, rid: str
) -> str | None:
    """D side: wait for the paired P's prefill; None when the KV is there (or no fabric)."""
    if state.fabric is None or not gen.is_remote_decode or gen.kv_in is None:
        return None
    engine_id = str(gen.kv_in.get("remote_engine_id"))
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
    request: Request,
    drop_at: int | None,
) -> AsyncIterator[bytes]:
    """SSE body like vLLM's: (chat: role chunk), token chunks, finish chunk, usage, [DONE]."""
    outcome = "cancelled"
    try:
        first = True
        if gen.chat:
            yield _sse(gen.chunk("", None, first=True))
            first = False
        for i in range(gen.n_tokens):
            if state.behavior.token_delay_s > 0:
                await asyncio.sleep(state.behavior.token_delay_s)
            if drop_at is not None and i >= drop_at:
                outcome = "dropped"
                raise _DroppedStream
            last = i == gen.n_tokens - 1
            yield _sse(gen.chunk(gen.token(i), "length" if last else None, first=first))
            first = False
        opts = gen.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage_chunk = gen.chunk(None, None, first=False)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = gen.usage(gen.n_tokens)
            yield _sse(usage_chunk)
        yield b"data: [DONE]\n\n"
        outcome = "ok"
    finally:
        state._leave(rec, outcome)


class UvicornThread:
    """Serves any ASGI app on ``127.0.0.1:<free port>`` with uvicorn in a daemon thread.

    ``lifespan`` is passed to uvicorn ("on" for apps with startup work, like the router).
    Use as a context manager or call ``start()``/``stop()``; ``url`` is the base URL.
    """

    def __init__(self, app: Any, lifespan: Literal["on", "off"] = "on") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            lifespan=lifespan,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> UvicornThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> UvicornThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeVllmServer(UvicornThread):
    """One fake vLLM instance on a free loopback port; ``state`` steers and records it."""

    def __init__(self, state: FakeVllmState | None = None) -> None:
        self.state = state or FakeVllmState()
        super().__init__(create_fake_app(self.state), lifespan="off")


@contextmanager
def fake_vllm(state: FakeVllmState | None = None) -> Iterator[FakeVllmServer]:
    """Context manager: a started fake, stopped on exit."""
    server = FakeVllmServer(state)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m router.devstack.fake_vllm --port N``: serve one fake until interrupted."""
    parser = argparse.ArgumentParser(description="fake vLLM OpenAI server (P/D aware)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prefill-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    identity = PushIdentity(engine_id=args.engine_id) if args.engine_id else PushIdentity()
    state = FakeVllmState(
        model=args.model,
        behavior=FakeBehavior(prefill_delay_s=args.prefill_delay, token_delay_s=args.token_delay),
        identity=identity,
    )
    uvicorn.run(
        create_fake_app(state),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
