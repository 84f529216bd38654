"""Push mode on real vLLM CPU with *our* connector (``connector`` package) on P and D, 1P1D.

The same cases as ``test_e2e_push.py`` (issue 3: the two connectors are interchangeable). Skipped
while the connector's vLLM facade is not importable in this checkout.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import RunningRouter, make_prompt, module_stack, router_completion, running_router
from pd_cases import PDRouterCases

from router.devstack.stack import Stack, StackOptions

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("connector.facade") is None,
        reason="connector.facade (our vLLM connector) is not in this checkout",
    ),
]


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    with module_stack(StackOptions(kind="ours", topology="1p1d"), e2e_dir) as started:
        yield started


@pytest.fixture(scope="module")
def router(stack: Stack) -> Iterator[RunningRouter]:
    with running_router(stack) as running:  # identity discovered from P
        router_completion(running.client(), stack.model_name, make_prompt("warmup"), False)
        yield running


class TestOurs1P1D(PDRouterCases):
    tag = "ours"
