"""Pull mode on real vLLM CPU with vLLM's ``NixlConnector`` (1P1D), plus the reference check.

The stack has a third instance ``a0`` started without any KV connector: it verifies that the
reference used by every e2e case (a plain request straight to a prefill instance) is exactly what
one aggregated instance answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import (
    RunningRouter,
    make_prompt,
    module_stack,
    reference_text,
    router_completion,
    running_router,
)
from tests.e2e.pd_cases import PDRouterCases

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="vllm-pull", topology="1p1d", with_aggregated=True, enforce_eager=True
    )
    with module_stack(options, e2e_dir) as started:
        yield started


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    with running_router(stack) as running:
        router_completion(running.client(), stack.model_name, make_prompt("warmup"), False)
        yield running


class TestPull1P1D(PDRouterCases):
    tag = "pull"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_plain_request_to_prefill_equals_aggregated_instance(stack: Stack, chat: bool) -> None:
    aggregated = stack.aggregated[0]
    for i in range(3):
        prompt = make_prompt(f"reference-{chat}-{i}", words=50 + 150 * i)
        want = reference_text(aggregated, stack.model_name, prompt, chat)
        assert reference_text(stack.prefill[0], stack.model_name, prompt, chat) == want
        assert reference_text(stack.decode[0], stack.model_name, prompt, chat) == want


def test_outputs_depend_on_the_whole_prompt(stack: Stack) -> None:
    """Guards the equality checks: a change early in the prompt changes the greedy output."""
    aggregated = stack.aggregated[0]
    prompt = make_prompt("sensitivity")
    changed = "zebra " + prompt[6:]
    assert reference_text(aggregated, stack.model_name, prompt, False) != reference_text(
        aggregated, stack.model_name, changed, False
    )
