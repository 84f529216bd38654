"""The connector with tensor parallelism, end to end: real vLLM CPU, P and D at TP 1 and TP 2.

One stack of four instances serves every combination: ``p0`` (P, TP 1), ``p1`` (P, TP 2), ``d0``
(D, TP 1), ``d1`` (D, TP 2); a TP 2 instance runs two workers (multiprocess executor), both on
its instance's core, so P's and D's workers never share a core. The tiny model has 2 KV heads,
so a TP 2 rank holds one: P TP 2 -> D TP 1 writes each P rank's head at its offset of D's
blocks (D waits for both ranks), P TP 1 -> D TP 2 writes each D rank its head, TP 2 -> TP 2
goes rank to rank. Every combination runs the cases of ``parallel_cases``: greedy output equal
to an aggregated request at D's TP size with no recompute on D, and KV back to 0 everywhere
after a P abort, a D abort and a client disconnect. Run under ``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import module_stack
from tests.e2e.parallel_cases import CASES, EXTRA, named

pytestmark = [pytest.mark.vllm]

PAIRS = [("p1", "d0"), ("p0", "d1"), ("p1", "d1")]  # TP 2 -> 1, 1 -> 2, 2 -> 2


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="2p2d",
        tensor_parallel={"p1": 2, "d1": 2},
        connector_extra_config=EXTRA,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("p_name", "d_name"), PAIRS)
async def test_tensor_parallel_pair(stack: Stack, p_name: str, d_name: str, case: str) -> None:
    p, d = named(stack, p_name), named(stack, d_name)
    await CASES[case](stack, p, d, f"tp-{p_name}-{d_name}")
