"""A D that dies, on real vLLM CPU (1P2D, our connector, one stack for the module): before its
first token, and after its first tokens.

Before the first token: the request goes on with the same P and the other D, and P serves the
retry from its prefix cache instead of prefilling the prompt again. D0 is stopped (SIGSTOP to its
whole process group: its port still accepts, nothing answers), the request goes out (round robin
pairs P with D0 first), P's prefill ends (its finished-requests counter moves), then D0 is killed:
D's leg breaks, the router retries once keeping P and taking D1. Ordered by what P reports, not
by time.

After its first tokens (a completion and a chat): the stream goes on on the other D; the client
gets one stream of all its tokens, P computes only the tokens generated before the seam (and
partial blocks) again, KV usage returns to zero. Round robin sends a new router's first request
to D0. The client reads the stream; after 10 tokens D0 is stopped (SIGSTOP: what it sent is still
relayed) and killed (SIGKILL): its connection breaks, and the router continues the stream with P
and D1. Ordered by what the client has read, not by time.

Each case restarts the D0 it killed, so the next one starts with two D again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.stack import Stack, StackInstance
from devstack.vllm_server import read_metrics_text
from tests.e2e.e2e_support import make_prompt, metrics, running_router
from tests.e2e.failover_support import (
    OURS,
    block_size,
    failover_stack,
    restart,
    stopped,
    until_kv_freed,
)
from tests.support.wait import wait_until

pytestmark = OURS

TOKENS = 64
SEAM = 10


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    with failover_stack(e2e_dir) as started:
        yield started


def test_a_d_killed_before_its_first_token_leaves_p_no_second_prefill(stack: Stack) -> None:
    [p], [d0, d1] = stack.prefill, stack.decode
    block = block_size(p)
    timeouts = {"prefill": 60.0, "first_token": 90.0, "total": 120.0}
    with running_router(
        stack, with_identity=True, timeouts=timeouts, health_interval_s=3600.0
    ) as router:
        before_p, before_d1 = metrics(p), metrics(d1)
        body = {"model": stack.model_name, "prompt": make_prompt("failover", 1500), "max_tokens": 8}
        answer: dict[str, httpx.Response] = {}

        def send() -> None:
            answer["r"] = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)

        def moved(instance: StackInstance, before: dict[str, float], name: str) -> float:
            return metrics(instance).get(name, 0.0) - before.get(name, 0.0)

        finished = "vllm:request_success_total"
        client = threading.Thread(target=send)
        with stopped(d0):
            client.start()
            wait_until(
                lambda: moved(p, before_p, finished) > 0,
                timeout=60.0,
                what="P's prefill to end (D0 stopped)",
            )
            d0.server.kill()  # D's leg breaks: the router retries with P and D1
        client.join(timeout=120)
        assert not client.is_alive(), "the client got no answer"
        resp = answer["r"]
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
        routed = read_metrics_text(text)
        assert routed["disagg_router_retries_total"] == 1.0
        assert routed["disagg_router_decode_failovers_total"] == 1.0
        kept = 'disagg_router_decode_failovers_total{phase="before_first_token",prefill="kept"}'
        assert f"{kept} 1.0" in text
        prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        hits = moved(p, before_p, "vllm:prefix_cache_hits_total")
        # The retry's prefill found every full block of the prompt in P's cache: P computed at
        # most the last partial block of the prompt a second time.
        print(f"\nprompt {prompt_tokens} tokens, block {block}: P's cache served {hits:g}")
        assert hits >= prompt_tokens - block, (hits, prompt_tokens, block)
        assert moved(d1, before_d1, finished) == 1.0  # D1 decoded it
        until_kv_freed((p, d1))
    restart(stack, d0)  # the next case starts with two D again


def _stream(
    url: str, body: dict[str, Any], chat: bool, on_text: Any = None
) -> tuple[list[str], Any]:
    """The texts of a stream's events and its usage; ``on_text(n)`` after the ``n``-th event
    with text."""
    texts: list[str] = []
    usage = None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = choice["delta"].get("content") if chat else choice["text"]
                if text:
                    texts.append(text)
                    if on_text is not None:
                        on_text(len(texts))
    return texts, usage


def _body(model: str, chat: bool) -> dict[str, Any]:
    prompt = make_prompt(f"migration-{chat}", 1500)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:  # the continuation's prompt goes as ids in kv_transfer_params.prompt_token_ids
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_whose_d_is_killed_after_10_tokens_ends_whole_on_the_other_d(
    stack: Stack, chat: bool
) -> None:
    [p], [d0, d1] = stack.prefill, stack.decode
    block = block_size(p)
    body = _body(stack.model_name, chat)
    timeouts = {"prefill": 60.0, "first_token": 90.0, "total": 120.0}
    with running_router(stack, timeouts=timeouts, health_interval_s=3600.0) as router:
        whole, _ = _stream(router.url, body, chat)  # the uninterrupted run, on P and D0
    with running_router(stack, timeouts=timeouts, health_interval_s=3600.0) as router:
        before_p = metrics(p)

        def kill_d0(n: int) -> None:
            if n == SEAM:
                with stopped(d0):
                    d0.server.kill()

        texts, usage = _stream(router.url, body, chat, kill_d0)
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
    after_p = metrics(p)
    assert 'disagg_router_stream_migrations_total{outcome="resumed"} 1.0' in text
    assert read_metrics_text(text)["disagg_router_stream_migrations_total"] == 1.0
    assert usage["completion_tokens"] == TOKENS, usage
    joined = "".join(texts)
    print(f"\n{len(texts)} events; joined equals the uninterrupted run: {joined == ''.join(whole)}")
    assert joined == "".join(whole)
    queries = (
        after_p["vllm:prefix_cache_queries_total"] - before_p["vllm:prefix_cache_queries_total"]
    )
    hits = after_p["vllm:prefix_cache_hits_total"] - before_p["vllm:prefix_cache_hits_total"]
    # P's two prefills (the request's, whose prompt the first run left cached, and the
    # continuation's) computed at most the tokens generated before the seam and a block each.
    print(f"P computed {queries - hits:g} of {queries:g} prompt tokens; block {block}")
    assert queries - hits <= TOKENS + 2 * block, (queries, hits)
    until_kv_freed((p, d1))
    restart(stack, d0)  # the next case starts with two D again
