"""The fake vLLM's routes beside generation: tokenizer, pooling, scoring and the Responses API,
shaped like vLLM 0.32's answers.

Who uses it: :func:`devstack.fakes.vllm_app.create_fake_app` adds them with
:func:`add_passthrough_routes`. Each route checks the fields vLLM requires (a 400 naming the
field when one is missing) and the ``model`` (vLLM's 404 for another name; none: the served
one), then follows the behaviour's ``fail_status`` / ``hang`` / ``fail_times`` like generation
does (a streamed Responses answer also ``drop_after_tokens``, counted in events), and records
the request. Tokens are the prompt's words (``tok<i>``); vectors and scores are
fixed numbers: the router never looks inside them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from devstack.fakes.state import FakeVllmState, RecordedRequest

_HANG_CAP_S = 600.0

Answer = Callable[[FakeVllmState, dict[str, Any]], dict[str, Any]]
Record = Callable[[FakeVllmState, Request], Awaitable[tuple[RecordedRequest, Any]]]


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _words(value: Any) -> list[str]:
    """The words of a prompt, an input or a list of them (the fake's tokens)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [w for item in value for w in _words(item)]
    if isinstance(value, dict):
        return _words(value.get("content", value.get("text", "")))
    return []


def _inputs(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _usage(body: dict[str, Any], key: str) -> dict[str, int]:
    n = max(1, len(_words(body.get(key))))
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def _tokenize(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    words = _words(body.get("messages") if "messages" in body else body.get("prompt"))
    tokens = list(range(1, len(words) + 1))
    return {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


def _detokenize(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "".join(f" tok{t}" for t in body["tokens"]).strip()}


def _listed(state: FakeVllmState, prefix: str, data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": state.model,
        "data": data,
    }


def _embeddings(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    data = [
        {"index": i, "object": "embedding", "embedding": [0.25, -0.5, 0.125]}
        for i, _ in enumerate(_inputs(body["input"]))
    ]
    return {**_listed(state, "embd", data), "usage": _usage(body, "input")}


def _cohere_embed(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    texts = _inputs(body["texts"])
    return {
        "id": uuid.uuid4().hex,
        "embeddings": {"float": [[0.25, -0.5, 0.125] for _ in texts]},
        "texts": texts,
        "meta": {"billed_units": {"input_tokens": len(_words(texts))}},
    }


def _pooling(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    data = [
        {"index": i, "object": "pooling", "data": [0.5, 0.5]}
        for i, _ in enumerate(_inputs(body["input"]))
    ]
    return {**_listed(state, "pool", data), "usage": _usage(body, "input")}


def _classify(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    data = [
        {"index": i, "label": "LABEL_0", "probs": [0.75, 0.25], "num_classes": 2}
        for i, _ in enumerate(_inputs(body["input"]))
    ]
    return {**_listed(state, "classify", data), "usage": _usage(body, "input")}


_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"))


def _score(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    second = next(b for a, b in _SCORE_PAIRS if a in body and b in body)
    data = [
        {"index": i, "object": "score", "score": 0.5} for i, _ in enumerate(_inputs(body[second]))
    ]
    return {**_listed(state, "score", data), "usage": _usage(body, second)}


def _rerank(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    docs = _inputs(body["documents"])
    results = [
        {"index": i, "document": {"text": str(d)}, "relevance_score": 0.5}
        for i, d in enumerate(docs)
    ]
    usage = _usage(body, "documents")
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": state.model,
        "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]},
        "results": results,
    }


ROUTES: dict[str, tuple[tuple[str, ...], Answer]] = {
    "/tokenize": (("prompt", "messages"), _tokenize),
    "/detokenize": (("tokens",), _detokenize),
    "/v1/embeddings": (("input",), _embeddings),
    "/v2/embed": (("texts",), _cohere_embed),
    "/pooling": (("input",), _pooling),
    "/classify": (("input",), _classify),
    "/score": (("queries", "text_1", "data_1"), _score),
    "/v1/score": (("queries", "text_1", "data_1"), _score),
    "/rerank": (("query",), _rerank),
    "/v1/rerank": (("query",), _rerank),
    "/v2/rerank": (("query",), _rerank),
}
"""Path -> (fields of which the request needs one, the answer's builder)."""


def _rejected(state: FakeVllmState, body: Any, needs: tuple[str, ...]) -> JSONResponse | None:
    """vLLM's 400 (a field missing) or 404 (another model), else None."""
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object", None, "BadRequestError")
    if not any(key in body for key in needs):
        return _error(400, f"Field required: {needs[0]}", needs[0], "BadRequestError")
    if "tokens" in needs and not all(isinstance(t, int) for t in _inputs(body["tokens"])):
        return _error(400, "tokens must be integers", "tokens", "BadRequestError")
    model = body.get("model")
    if model is not None and model != state.model:
        return _error(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
    return None


async def _injected(state: FakeVllmState, request: Request) -> JSONResponse | None:
    """The behaviour's failure for this request (after a hang, if it hangs), else None."""
    b = state.behavior
    if (b.fail_status is None and not b.hang) or not state._take_failure():
        return None
    if b.hang:
        deadline = time.monotonic() + _HANG_CAP_S
        while time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.01)
        return _error(500, "hang cap reached", None, "InternalServerError")
    assert b.fail_status is not None
    return _error(b.fail_status, "injected failure", None, "InternalServerError")


def _responses_answer(state: FakeVllmState, body: dict[str, Any]) -> dict[str, Any]:
    """A completed ``ResponsesResponse`` (vLLM's fields the router could care about)."""
    words = _words(body.get("input"))
    n = body.get("max_output_tokens") or state.behavior.default_max_tokens
    text = "".join(f" tok{i}" for i in range(n))
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": state.model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {"input_tokens": len(words), "output_tokens": n, "total_tokens": len(words) + n},
        "kv_transfer_params": None,
    }


class _Dropped(Exception):
    """Raised inside an event stream to make uvicorn abort the connection there."""


async def _responses_events(answer: dict[str, Any], drop_at: int | None) -> AsyncIterator[bytes]:
    """vLLM's event stream: ``event: <type>`` lines, no ``[DONE]`` at the end; ``drop_at``: the
    connection breaks before that event."""
    text = answer["output"][0]["content"][0]["text"]
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**answer, "status": "in_progress"}}
    ]
    events += [
        {"type": "response.output_text.delta", "delta": word, "output_index": 0}
        for word in text.split(" ")[1:]
    ]
    events.append({"type": "response.completed", "response": answer})
    for n, event in enumerate(events):
        if drop_at is not None and n >= drop_at:
            raise _Dropped
        data = json.dumps({**event, "sequence_number": n})
        yield f"event: {event['type']}\ndata: {data}\n\n".encode()


def add_passthrough_routes(app: FastAPI, state: FakeVllmState, record: Record) -> None:
    """Add :data:`ROUTES` and ``/v1/responses`` to the fake's ``app``; ``record`` records a
    request as it arrives (the app's own recorder)."""
    for path, (needs, build) in ROUTES.items():
        app.add_api_route(path, _endpoint(state, record, needs, build), methods=["POST"])
    responses = _endpoint(state, record, ("input",), None)
    app.add_api_route("/v1/responses", responses, methods=["POST"])


def _endpoint(
    state: FakeVllmState, record: Record, needs: tuple[str, ...], build: Answer | None
) -> Callable[[Request], Any]:
    """One route's handler; ``build`` None: the Responses API (streamed when asked)."""

    async def handle(request: Request) -> Response:
        rec, body = await record(state, request)
        failed = _rejected(state, body, needs) or await _injected(state, request)
        if failed is not None:
            rec.outcome = "error"
            return failed
        rec.outcome = "ok"
        if build is not None:
            return JSONResponse(build(state, body))
        answer = _responses_answer(state, body)
        if body.get("stream"):
            drop_at = state.behavior.drop_after_tokens
            if drop_at is not None and not state._take_failure():
                drop_at = None
            events = _responses_events(answer, drop_at)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(answer)

    return handle
