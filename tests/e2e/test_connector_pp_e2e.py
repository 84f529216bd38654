"""The connector with a pipeline-parallel P, end to end: real vLLM CPU, P PP 2 -> D TP 1.

One stack of three instances: ``p0`` (P, PP 1: the aggregated reference), ``p1`` (P, PP 2: two
workers, one per pipeline stage, both on P's core, each holding one of the tiny model's two
layers) and ``d0`` (D, TP 1). Each stage of ``p1`` listens on its own side channel (the base
port + its vLLM rank) and writes its layer into D's region of that layer; D registers with both
stages and decodes once both ``done`` notifications arrived. The cases are those of
``parallel_cases``: greedy output equal to an aggregated request with no recompute on D, and KV
usage back to 0 on every instance after a P abort, a D abort and a client disconnect. Run under
``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import module_stack
from tests.e2e.parallel_cases import CASES, EXTRA, named

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="2p1d",
        pipeline_parallel={"p1": 2},
        connector_extra_config=EXTRA,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


@pytest.mark.parametrize("case", list(CASES))
async def test_pipeline_parallel_p(stack: Stack, case: str) -> None:
    await CASES[case](stack, named(stack, "p1"), named(stack, "d0"), "pp-p1-d0")
