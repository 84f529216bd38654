"""A hybrid-attention model through the connector on real vLLM CPU.

One small stack: P and D with our connector, plus one aggregated instance ``a0``
without a connector. D's greedy answer (tokens, log-probabilities) must equal ``a0``'s, and D
must have taken the whole prompt from P
(``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``).

* ``gemma3`` (one sliding-window layer of 64 tokens, one full-attention layer): our connector
  does not implement ``SupportsHMA``, so vLLM turns the hybrid KV cache manager off on P and D;
  the sliding-window layer's KV cache is then allocated like a full-attention one (every token
  kept), all layers form one KV cache group and P's WRITE carries every layer of every block.
  ``a0`` keeps the hybrid manager (two groups; blocks outside the window are dropped), so its
  answer is the model's own hybrid-mode output.

MLA (``deepseek_v2``) runs at TP 1 and 2 and PP 2 in ``test_connector_mla_parallel_e2e.py``.
Two requests; run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import Stack, StackInstance, StackOptions
from tests.e2e.e2e_support import module_stack
from tests.e2e.test_connector_e2e import (
    BLOCK,
    MAX_TOKENS,
    OURS_EXTRA,
    TIMEOUT,
    _body,
    assert_same,
    disagg_legs,
    tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.shapes]

HMA_OFF = "Hybrid KV cache manager is disabled for this hybrid model"


@pytest.fixture(scope="module", params=["gemma3"])
def stack(request: pytest.FixtureRequest, e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        model_shape=request.param,
        with_aggregated=True,
        max_model_len=4096,
        connector_extra_config=OURS_EXTRA,
        enforce_eager=True,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


async def aggregated_on(
    client: httpx.AsyncClient, instance: StackInstance, prompt: list[int]
) -> dict[str, Any]:
    """A plain request (no ``kv_transfer_params``) to ``instance``; its JSON."""
    response = await client.post(
        instance.url + "/v1/completions", json=_body(prompt, MAX_TOKENS, None)
    )
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def external_prompt_tokens(instance: StackInstance) -> float:
    """D's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``."""
    response = httpx.get(instance.url + "/metrics", timeout=httpx.Timeout(10.0))
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_by_source_total"
        and sample.labels.get("source") == "external_kv_transfer"
    )


def log(instance: StackInstance) -> str:
    return instance.server.log_path.read_text(errors="replace")


def test_the_shape_runs_as_claimed(stack: Stack) -> None:
    """vLLM promoted the sliding-window layer on P and D (one KV cache group), not on ``a0``."""
    p, d, a0 = stack.prefill[0], stack.decode[0], stack.aggregated[0]
    assert HMA_OFF in log(p) and HMA_OFF in log(d)
    assert HMA_OFF not in log(a0)


@pytest.mark.parametrize("length", [300, 5 * BLOCK + 17], ids=["unaligned", "many"])
async def test_pushed_kv_of_a_hybrid_model_equals_the_hybrid_aggregated_answer(
    stack: Stack, length: int
) -> None:
    prompt = tokens(f"{stack.options.model_shape}-{length}", length)
    d = stack.decode[0]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        ref = await aggregated_on(client, stack.aggregated[0], prompt)
        before = external_prompt_tokens(d)
        _, got = await disagg_legs(client, stack, prompt, uuid.uuid4().hex)
    assert_same(got, ref)
    # D computed at most the last prompt token itself (vLLM recomputes it to sample the next).
    assert length - 1 <= external_prompt_tokens(d) - before <= length
