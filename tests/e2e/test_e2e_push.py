"""Push mode on real vLLM CPU with vLLM's ``NixlPushConnector``: 1P1D and 2P1D through the router.

One 2P1D stack serves the module (p0 and p1 on core 0, d0 on core 1): the 1P1D cases run through a
router that knows only p0 and d0; the 2P1D case through a router that knows both prefills and
discovers their identities itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    with module_stack(StackOptions(kind="vllm-push", topology="2p1d"), e2e_dir) as started:
        yield started


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    """A 1P1D push router (p0, d0) with p0's identity from the config; warmed up once."""
    with running_router(stack, with_identity=True, prefill_names=["p0"]) as running:
        # The first transfer between two engines includes the NIXL handshake; keep it out of
        # the cases (its output is still checked by them, on other prompts).
        router_completion(running.client(), stack.model_name, make_prompt("warmup"), False)
        yield running


class TestPush1P1D(PDRouterCases):
    tag = "push"


def test_push_2p1d_spreads_over_both_prefills_and_pairs_correctly(stack: Stack) -> None:
    prompts = [make_prompt(f"push-2p1d-{i}") for i in range(8)]
    p0, p1 = stack.prefill
    with running_router(stack, with_identity=False) as router:  # identities discovered
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
