"""A stream whose D breaks after its first tokens goes on on another D: the router app over
scripted P and D instances (real HTTP), the client's stream checked event by event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from disagg_router.router import create_app
from disagg_router.router.config import settings_from_mapping
from tests.support.scripted import scripted
from tests.unit.router.mock_upstream import KV, answer, asgi_messages

PROMPT = [11, 12, 13]
SSE = {"content-type": "text/event-stream"}


def _event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _token(
    rid: str, text: str, tid: int, finish: str | None = None, prompt: list[int] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "token_ids": [tid], "finish_reason": finish}
    choice["prompt_token_ids"] = prompt  # vLLM: the prompt's ids in the first chunk's choice
    return {"id": rid, "object": "text_completion", "created": 1, "choices": [choice]}


class Fleet:
    """1P2D as vLLM answers with ``return_token_ids``: the first D sends three tokens and then
    dies (its connection breaks); the second continues from the ids it is given."""

    def __init__(self) -> None:
        self.prefills: list[tuple[int | None, Any]] = []
        self.decodes: list[tuple[int | None, dict[str, Any]]] = []
        self.dying: int | None = None  # the D port that breaks

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        body = json.loads(request.content)
        if body["kv_transfer_params"].get("do_remote_decode"):
            if body["kv_transfer_params"].get("identity_probe"):
                return httpx.Response(200, json=answer("a", KV))
            self.prefills.append((request.url.port, body["prompt"]))
            prompt = body["prompt"] if isinstance(body["prompt"], list) else PROMPT
            done = answer("a", {**KV, "remote_prefill_cached_tokens": len(PROMPT)})
            done["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": 1}
            return httpx.Response(200, json=done)  # P's cache held the first prompt
        self.decodes.append((request.url.port, body))
        if self.dying is None:
            self.dying = request.url.port
        return httpx.Response(200, content=self._stream(body, request.url.port), headers=SSE)

    async def _stream(self, body: dict[str, Any], port: int | None) -> AsyncIterator[bytes]:
        prompt = body["prompt"] if isinstance(body["prompt"], list) else PROMPT
        if port == self.dying:
            yield _event(_token("cmpl-d0", "one", 1, prompt=prompt))
            yield _event(_token("cmpl-d0", " two", 2)) + _event(_token("cmpl-d0", " three", 3))
            raise ConnectionResetError("the engine died")
        yield _event(_token("cmpl-d1", " four", 4, prompt=prompt))
        yield _event(_token("cmpl-d1", " five", 5, finish="length"))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": 0}
        yield _event({"id": "cmpl-d1", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


async def test_a_stream_whose_d_dies_mid_way_goes_on_on_the_other_d_with_the_same_p() -> None:
    fleet = Fleet()
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with scripted(fleet, 3) as (p, d0, d1):
        settings = settings_from_mapping(
            {
                "models": ["m"],
                "prefill": {"instances": [{"url": p.url}]},
                "decode": {
                    "instances": [{"url": d0.url}, {"url": d1.url}],
                    "policy": "round_robin",
                },
            }
        )
        app = create_app(settings)
        runtimes: list[Any] = []
        messages = await asgi_messages(app, body, lambda _: runtimes.append(app.state.runtime))
        registry = runtimes[-1].metrics.registry
    written = b"".join(m["body"] for m in messages if m["type"] == "http.response.body")
    events = [e.removeprefix(b"data: ") for e in written.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"cmpl-d0"}
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "one two three four five"
    assert all(c["choices"][0].keys() == {"index", "text", "finish_reason"} for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    (d0_port, first), (d1_port, second) = fleet.decodes
    assert d0_port != d1_port and first["prompt"] == "hi"
    assert second["prompt"] == [*PROMPT, 1, 2, 3] and second["max_tokens"] == 2
    assert [port for port, _ in fleet.prefills] == [p.port, p.port]  # the same P, twice
    assert fleet.prefills[1][1] == [*PROMPT, 1, 2, 3]

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("disagg_router_stream_migrations_total", outcome="resumed") == 1.0
    after = {"phase": "after_first_token", "prefill": "kept"}
    assert sample("disagg_router_decode_failovers_total", **after) == 1.0
    computed = "disagg_router_failover_prefill_computed_tokens"
    assert sample(f"{computed}_count", phase="after_first_token") == 1.0
    assert sample(f"{computed}_sum", phase="after_first_token") == 3.0  # the 3 generated
    ok = {"mode": "push", "endpoint": "completions", "model": "m", "outcome": "ok"}
    assert sample("disagg_router_requests_total", **ok) == 1.0
