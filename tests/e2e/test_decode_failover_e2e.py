"""A D that dies before the first token, on real vLLM CPU (1P2D, our connector): the request goes
on with the same P and the other D, and P serves the retry from its prefix cache instead of
prefilling the prompt again.

D0 is stopped (SIGSTOP to its whole process group: its port still accepts, nothing answers), the
request goes out (round robin pairs P with D0 first), P's prefill ends (its finished-requests
counter moves), then D0 is killed: D's leg breaks, the router retries once keeping P and taking D1.
Ordered by what P reports, not by time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devstack.stack import Stack, StackInstance
from devstack.vllm_server import read_metrics_text
from tests.e2e.e2e_support import kv_blocks, make_prompt, metrics, running_router
from tests.e2e.failover_support import (
    LEASE_S,
    MARGIN_S,
    OURS,
    block_size,
    failover_stack,
    stopped,
)
from tests.support.wait import wait_until

pytestmark = OURS


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
        for instance in (p, d1):
            wait_until(
                lambda instance=instance: kv_blocks(instance) == 0,  # type: ignore[misc]
                timeout=LEASE_S + MARGIN_S,
                what=f"{instance.name}'s KV blocks back to 0",
            )
