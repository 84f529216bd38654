"""The connector with tensor and pipeline parallelism, end to end: real vLLM CPU.

One stack of five instances serves every combination: ``p0`` (P, TP 1), ``p1`` (P, TP 2), ``p2``
(P, PP 2), ``d0`` (D, TP 1), ``d1`` (D, TP 2). An instance's workers (two for ``p1``, ``p2`` and
``d1``, multiprocess executor) all run on its instance's core, so P's and D's workers never share
a core. The tiny model has 2 KV heads and 2 layers:

- TP: a TP 2 rank holds one head. P TP 2 -> D TP 1 writes each P rank's head at its offset of
  D's blocks (D waits for both ranks), P TP 1 -> D TP 2 writes each D rank its head, TP 2 -> TP 2
  goes rank to rank;
- PP: each stage of ``p2`` holds one layer, listens on its own side channel (the base port + its
  vLLM rank) and writes its layer into D's region of that layer; D registers with both stages and
  decodes once both ``done`` notifications arrived.

Every pair runs the cases of ``parallel_cases``: greedy output equal to an aggregated request at
D's TP size with no recompute on D, and KV back to 0 everywhere after a P abort, a D abort and a
client disconnect. Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import module_stack
from tests.e2e.parallel_cases import CASES, EXTRA, named
from tests.e2e.test_connector_e2e import LOG_REQUESTS

pytestmark = [pytest.mark.vllm, pytest.mark.shapes]

STEP_TOKENS = ("--max-num-batched-tokens", "1024")
"""Prefill chunks of 1024 tokens (vLLM CPU's default is 4096): an abort takes effect only after
the engine step under way, and a 4096-token step of the P abort case's 16,000-token prompt took
over 60 s on a TP 2 instance here (its two workers share one core), more than D's transfer
timeout on a slow day. Every prompt of the other cases fits one chunk."""
PAIRS = [("p1", "d0"), ("p0", "d1"), ("p1", "d1"), ("p2", "d0")]
"""TP 2 -> 1, TP 1 -> 2, TP 2 -> 2, PP 2 -> TP 1."""


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="3p2d",
        tensor_parallel={"p1": 2, "d1": 2},
        pipeline_parallel={"p2": 2},
        connector_extra_config=EXTRA,
        extra_args=STEP_TOKENS + LOG_REQUESTS,
        enforce_eager=True,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("p_name", "d_name"), PAIRS)
async def test_parallel_pair(stack: Stack, p_name: str, d_name: str, case: str) -> None:
    p, d = named(stack, p_name), named(stack, d_name)
    await CASES[case](stack, p, d, f"par-{p_name}-{d_name}")
