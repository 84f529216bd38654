"""Push mode on real vLLM CPU with vLLM's ``NixlPushConnector``, 1P1D through the router.

The router's 2P1D case runs with our connector (``test_e2e_ours.py``): vLLM's NIXL connectors
keep one core busy per instance (nixl 1.5.1's progress thread polls with a delay of 0, see
docs/notes/vllm-facts.md), and three such instances on a 2-core machine starve each other
until transfers outlive P's lease.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import (
    RunningRouter,
    make_prompt,
    module_stack,
    router_completion,
    running_router,
)
from tests.e2e.pd_cases import PDRouterCases

pytestmark = [pytest.mark.vllm, pytest.mark.upstream_push]


# The first transfer of a fresh P/D pair is slow (NIXL handshake, vLLM preparing descriptors for
# every block of D, a starved core) and can outlive P's 30 s lease (docs/notes/vllm-facts.md,
# "Latency"), failing that request; the warm-up below absorbs it and retries.
PUSH_OPTIONS = StackOptions(kind="vllm-push", topology="1p1d", enforce_eager=True)
ROUTER_OPTIONS = {"identity_interval_s": 600.0}


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    """The 1P1D stack, its P/D pair warmed up once through a router.

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
