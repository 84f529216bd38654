"""Push mode on real vLLM CPU with *our* connector (``connector`` package) on P and D.

One 2P1D stack serves the module (p0 and p1 on core 0, d0 on core 1). The 1P1D cases (the same
as ``test_e2e_push.py``'s: the two connectors are interchangeable) run through a router
that knows only p0 and d0 and probes p0 for its identity; the 2P1D case through a router
that knows both prefills and probes them for their identities itself. Skipped while the connector's
vLLM facade is not importable in this checkout.

Why 2P1D runs with our connector in the default suite: vLLM's NIXL connectors keep one core busy
per instance (nixl 1.5.1's progress thread polls with a delay of 0, docs/notes/vllm-facts.md), so
three such instances on a 2-core machine starve each other; ours runs NIXL without that thread.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import (
    RunningRouter,
    make_prompt,
    metrics,
    module_stack,
    reference_text,
    router_completion,
    running_router,
)
from tests.e2e.parallel_cases import external_tokens
from tests.e2e.pd_cases import PDRouterCases

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("disagg_router.connector.facade") is None,
        reason="disagg_router.connector.facade (our vLLM connector) is not in this checkout",
    ),
]


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(kind="ours", topology="2p1d", enforce_eager=True)
    with module_stack(options, e2e_dir) as started:
        yield started


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    """A 1P1D push router (p0, d0); p0's identity probed from p0."""
    with running_router(stack, prefill_names=["p0"]) as running:
        router_completion(running.client(), stack.model_name, make_prompt("warmup"), False)
        yield running


class TestOurs1P1D(PDRouterCases):
    tag = "ours"


def test_ours_2p1d_spreads_over_both_prefills_and_pairs_correctly(stack: Stack) -> None:
    """Round-robin over p0 and p1: every request prefills on one of them, D registers with that
    P (a registration sent to the wrong P is refused and the request fails), output == aggregated.
    """
    prompts = [make_prompt(f"ours-2p1d-{i}") for i in range(8)]
    p0, p1 = stack.prefill
    with running_router(stack) as router:  # both identities probed
        before = {p.name: metrics(p).get("vllm:prompt_tokens_total", 0.0) for p in stack.prefill}
        client = router.client()
        got = [
            router_completion(client, stack.model_name, prompt, stream=i % 2 == 1)
            for i, prompt in enumerate(prompts)
        ]
        after = {p.name: metrics(p).get("vllm:prompt_tokens_total", 0.0) for p in stack.prefill}
    # Each P prefilled several of the ~300-word prompts (identity probes are a few tokens).
    for name in (p0.name, p1.name):
        assert after[name] - before[name] >= 2 * 300, (name, before, after)
    want = [reference_text(p0, stack.model_name, p, False) for p in prompts]
    assert got == want


def _prompt_tokens(stack: Stack) -> dict[str, float]:
    return {i.name: metrics(i).get("vllm:prompt_tokens_total", 0.0) for i in stack.instances}


def _cache_hits(stack: Stack) -> dict[str, float]:
    return {p.name: metrics(p).get("vllm:prefix_cache_hits_total", 0.0) for p in stack.prefill}


def test_prefix_affinity_keeps_each_conversation_on_one_prefill_whose_cache_hits(
    stack: Stack,
) -> None:
    """prefix_affinity over p0 and p1: every turn of a conversation (its own long system
    prompt, then growing turns) prefills on the same P, and from the second turn on that P's
    vLLM prefix cache serves at least most of the system prompt (vllm:prefix_cache_hits)."""
    systems = [make_prompt(f"affinity-system-{k}", words=200) for k in range(4)]
    home: dict[int, set[str]] = {k: set() for k in range(len(systems))}
    first_turn_tokens: list[float] = []
    later_turn_hits: list[float] = []
    overrides = {"prefill": {"prefix_chars": 512}}
    with running_router(stack, prefill_policy="prefix_affinity", overrides=overrides) as router:
        client = router.client()
        for turn in range(3):
            for k, system in enumerate(systems):
                prompt = system + "".join(f" user turn {t}." for t in range(turn + 1))
                tokens, hits = _prompt_tokens(stack), _cache_hits(stack)
                router_completion(client, stack.model_name, prompt, stream=False)
                tokens_after, hits_after = _prompt_tokens(stack), _cache_hits(stack)
                (served,) = [n for n in hits if tokens_after[n] - tokens[n] > 50]
                home[k].add(served)
                if turn == 0:
                    first_turn_tokens.append(tokens_after[served] - tokens[served])
                else:
                    later_turn_hits.append(hits_after[served] - hits[served])
    assert all(len(places) == 1 for places in home.values()), home
    assert {p for places in home.values() for p in places} == {p.name for p in stack.prefill}
    # a hit counts whole KV blocks: allow the system prompt's last partial block
    assert min(later_turn_hits) >= 0.8 * min(first_turn_tokens) - 32, (
        later_turn_hits,
        first_turn_tokens,
    )


def test_short_prompt_is_served_by_decode_alone_with_the_aggregated_output(
    stack: Stack,
) -> None:
    """A prompt under the disaggregation threshold goes to D alone: no P prefills it (no P
    leg, no transfer), D prefills it, and the output equals the aggregated output."""
    prompts = [make_prompt(f"short-{i}", words=40) for i in range(2)]
    overrides = {"disaggregation": {"min_prompt_tokens": 2048}}
    with running_router(stack, overrides=overrides) as router:
        client = router.client()
        before = _prompt_tokens(stack)
        got = [
            router_completion(client, stack.model_name, prompt, stream=i == 1)
            for i, prompt in enumerate(prompts)
        ]
        after = _prompt_tokens(stack)
    for p in stack.prefill:
        assert after[p.name] - before[p.name] < 10, (p.name, before, after)  # probes at most
    d = stack.decode[0].name
    assert after[d] - before[d] >= 2 * 40
    p0 = stack.prefill[0]
    assert got == [reference_text(p0, stack.model_name, p, False) for p in prompts]


def _binds(url: str) -> dict[str, float]:
    """The router's ``disagg_router_decode_binds_total`` by reason."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "disagg_router_decode_binds"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


@pytest.mark.parametrize(
    ("bind", "reasons"),
    [
        ("eager", {"eager"}),
        ("just_in_time", {"predicted", "prefill_done"}),
        ("adaptive", {"predicted", "prefill_done"}),  # every D is at least 0 % full: scarce
    ],
)
def test_each_bind_mode_serves_a_stream_whose_kv_d_did_not_compute(
    stack: Stack, bind: str, reasons: set[str]
) -> None:
    """push.bind: after three requests (P's speed learned; D's load signals scraped, every
    ``load_signals.interval``), a stream bound as the mode says; its greedy text equals the
    aggregated one and D took its prompt from the KV transfer
    (``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``), computing at most one
    token of it."""
    p0, d0 = stack.prefill[0], stack.decode[0]
    overrides = {"push": {"bind": bind, "adaptive_kv_usage": 0.0}}
    with running_router(stack, prefill_names=["p0"], overrides=overrides) as router:
        client = router.client()
        for i in range(3):
            router_completion(client, stack.model_name, make_prompt(f"bind-{bind}-{i}"), False)
        before, tokens, external = _binds(router.url), metrics(d0), external_tokens(d0)
        prompt = make_prompt(f"bind-{bind}-stream")
        got = router_completion(client, stack.model_name, prompt, stream=True)
        after, tokens_after = _binds(router.url), metrics(d0)
        pulled = external_tokens(d0) - external
    moved = {r for r in after if after[r] > before.get(r, 0.0)}
    assert moved <= reasons and sum(after.values()) - sum(before.values()) == 1, (before, after)
    prompt_tokens = tokens_after["vllm:prompt_tokens_total"] - tokens["vllm:prompt_tokens_total"]
    assert prompt_tokens > 100 and prompt_tokens - 1 <= pulled <= prompt_tokens
    assert got == reference_text(p0, stack.model_name, prompt, False)
