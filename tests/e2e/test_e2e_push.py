"""Push mode on real vLLM CPU with vLLM's ``NixlPushConnector``: 1P1D and 2P1D through the router.

One 2P1D stack serves the module (p0 and p1 on core 0, d0 on core 1): the 1P1D cases run through a
router that knows only p0 and d0; the 2P1D case through a router that knows both prefills and
discovers their identities itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from e2e_support import (
    RunningRouter,
    make_prompt,
    metrics,
    module_stack,
    reference_text,
    router_completion,
    running_router,
)
from pd_cases import PDRouterCases

from router.devstack.stack import Stack, StackOptions

pytestmark = [pytest.mark.vllm, pytest.mark.upstream_push]


# The first transfer of a P/D pair can stall until P's 30 s lease ends (docs/notes/vllm-facts.md,
# "Latency"), failing that request; the warm-up below absorbs it and retries.
PUSH_OPTIONS = StackOptions(kind="vllm-push", topology="2p1d")
ROUTER_OPTIONS = {"discovery_interval_s": 600.0}


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    """The 2P1D stack, each P/D pair warmed up once through a 1P1D router.

    The first transfer between two engines includes the NIXL handshake (and the first large
    prefill of an instance is slow); keep that out of the cases, which check other prompts.
    """
    with module_stack(PUSH_OPTIONS, e2e_dir) as started:
        for prefill in started.prefill:
            with running_router(started, prefill_names=[prefill.name], **ROUTER_OPTIONS) as one:
                for attempt in range(3):
                    prompt = make_prompt(f"warmup-{prefill.name}-{attempt}")
                    try:
                        router_completion(one.client(), started.model_name, prompt, False)
                        break
                    except openai.APIError as exc:
                        print(f"warm-up {prefill.name} attempt {attempt} failed: {exc}")
        yield started


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    """A 1P1D push router (p0, d0) with p0's identity from the config."""
    with running_router(
        stack, with_identity=True, prefill_names=["p0"], **ROUTER_OPTIONS
    ) as running:
        yield running


class TestPush1P1D(PDRouterCases):
    tag = "push"


def test_push_2p1d_spreads_over_both_prefills_and_pairs_correctly(stack: Stack) -> None:
    prompts = [make_prompt(f"push-2p1d-{i}") for i in range(8)]
    p0, p1 = stack.prefill
    with running_router(stack, **ROUTER_OPTIONS) as router:  # identities discovered
        before = {p.name: metrics(p).get("vllm:prompt_tokens_total", 0.0) for p in stack.prefill}
        client = router.client()
        got = [
            router_completion(client, stack.model_name, prompt, stream=i % 2 == 1)
            for i, prompt in enumerate(prompts)
        ]
        after = {p.name: metrics(p).get("vllm:prompt_tokens_total", 0.0) for p in stack.prefill}
    # Each P prefilled several of the ~300-word prompts (discovery probes are a few tokens).
    for name in (p0.name, p1.name):
        assert after[name] - before[name] >= 2 * 300, (name, before, after)
    want = [reference_text(p0, stack.model_name, p, False) for p in prompts]
    assert got == want
