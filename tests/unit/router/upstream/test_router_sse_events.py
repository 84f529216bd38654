"""D's event stream as the router relays it: cut into events from the bytes read, by the rules
``httpx-sse`` reads by, passed on unparsed except the event that carries a usage."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource

from disagg_router.router import create_app
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.upstream.sse import EventSplitter
from tests.unit.router.mock_upstream import KV, answer, asgi_messages, pair

OPENAI = (
    b"".join(
        b"data: " + json.dumps({"id": "x", "choices": [{"text": t}]}).encode() + b"\n\n"
        for t in ("a", "b", "\u00e9")  # JSON keeps non-ASCII as \\u escapes
    )
    + ('data: {"choices":[{"text":"\u00fc"}]}\n\n' + "data: [DONE]\n\n").encode()
)

STREAMS = [
    OPENAI,
    b"data:x\r\n\r\ndata: y\r\rdata: [DONE]\n\n",
    b": comment\n\nevent: e\ndata: 1\ndata: 2\n\ndata: \xff\xfe\n\ndata: [DONE]\n\ndata: late\n\n",
    b"data: a\n\n\n\n\ndata: b\n\n\n",
    b"id: 5\ndata: a\n\n\n\n\ndata: b\n\n\ndata: [DONE]\n\n",
    b"retry: 10\n\nevent: \n\ndata\n\ndata: [DONE]",
]


async def _httpx_sse(raw: bytes) -> tuple[bytes, bool]:
    """The events ``httpx-sse`` reads from ``raw`` as the client got them before, and whether
    it read ``[DONE]``."""
    resp = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=raw)
    resp.encoding = "utf-8"
    out: list[bytes] = []
    done = False
    async for event in EventSource(resp).aiter_sse():
        if done:
            continue
        if event.data == "[DONE]":
            done = True
            continue
        out.append(b"data: " + event.data.encode() + b"\n\n")
    return b"".join(out), done


def _split(raw: bytes, cuts: list[int]) -> tuple[bytes, bool]:
    splitter = EventSplitter()
    bounds = [0, *cuts, len(raw)]
    out = b"".join(splitter.feed(raw[a:b]) for a, b in itertools.pairwise(bounds))
    return out, splitter.done


@pytest.mark.parametrize("raw", STREAMS)
async def test_the_splitter_reads_what_httpx_sse_reads_however_the_bytes_arrive(raw: bytes) -> None:
    expected = await _httpx_sse(raw)
    rng = random.Random(raw)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(raw)), min(4, len(raw) - 1)))
        assert _split(raw, cuts) == expected, cuts
    # One event per read, as a decoding vLLM sends them (the splitter's shortcut for them).
    ends = [i + 2 for i in range(len(raw)) if raw.startswith(b"\n\n", i)]
    assert _split(raw, [i for i in ends if i < len(raw)]) == expected


def test_an_openai_stream_comes_out_as_the_bytes_read() -> None:
    splitter = EventSplitter()
    head, _, rest = OPENAI.partition(b"data: [DONE]")
    assert splitter.feed(head) == head
    assert splitter.feed(b"data: [DONE]" + rest) == b""
    assert splitter.done
    at_once = EventSplitter()
    assert at_once.feed(OPENAI) == head  # the whole stream in one read, [DONE] with it
    assert at_once.done


class _SlowPrefill:
    """P answers once ``release`` is set; D streams two events and a usage event in one body."""

    def __init__(self) -> None:
        self.release = threading.Event()  # set by the test, waited for in the server's thread
        self.prefill = ""

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        body = json.loads(request.content)
        if str(request.url).startswith(self.prefill):
            if not body["kv_transfer_params"].get("identity_probe"):
                await asyncio.to_thread(self.release.wait, 30)
            return httpx.Response(200, json={**answer("a", KV), "usage": _usage(7, 1)})
        chunks: list[dict[str, Any]] = [{"choices": [{"text": t}]} for t in ("a", "b")]
        chunks.append({"choices": [], "usage": _usage(3, 2)})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt}


async def test_events_before_the_usage_event_are_not_held_back_for_ps_usage() -> None:
    """D's one read holds tokens and the usage event: the tokens reach the client while P has
    not answered; the usage event follows with P's prompt tokens once it has."""
    upstream = _SlowPrefill()
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def release_p(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            upstream.release.set()  # P answers only once the client has the first write

    try:
        with pair(upstream) as (p, d):
            upstream.prefill = p
            pools = {"prefill": {"instances": [{"url": p}]}, "decode": {"instances": [{"url": d}]}}
            app = create_app(settings_from_mapping({"models": ["m"], **pools}))
            messages = await asgi_messages(app, body, release_p)
    finally:
        upstream.release.set()
    writes = [m["body"] for m in messages if m["type"] == "http.response.body"]
    first = [json.loads(e[6:]) for e in writes[0].split(b"\n\n") if e]
    assert [c["choices"][0]["text"] for c in first] == ["a", "b"]
    events = [e[6:] for e in b"".join(writes[1:]).split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[0])["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
    }
