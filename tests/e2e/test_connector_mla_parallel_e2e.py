"""MLA through the connector, end to end: real vLLM CPU, a DeepSeek-V2-shaped model at TP 1 and 2
and with a PP 2 P.

One stack of five instances of the tiny ``deepseek_v2`` model (vLLM's CPU MLA backend, one
latent KV tensor per layer): ``p0`` (P, TP 1), ``p1`` (P, TP 2), ``p2`` (P, PP 2), ``d0`` (D,
TP 1), ``d1`` (D, TP 2); a TP 2 or PP 2 instance runs two workers on its instance's core. Every
TP rank of an MLA model holds the whole latent cache, so the connector states it as one KV head
replicated on every rank: P rank 0 writes whole blocks into every D rank and P rank 1 sends
nothing. Each pipeline stage of ``p2`` writes its own layers' latent blocks. vLLM CPU's MLA
backend keeps one latent tensor per layer (``[blocks, 16 tokens, 576]``, no K/V split), which
the connector moves as one region per layer, and turns prefix caching off for MLA, so every
request moves its whole prompt. Each pair (TP 1 -> TP 1, P TP 2 -> D TP 1, P TP 1 -> D TP 2,
TP 2 -> TP 2, P PP 2 -> D TP 1) runs the cases of ``parallel_cases``: greedy output equal to an
aggregated request at D's TP size with no recompute on D, and KV back to 0 everywhere after a D
abort and a client disconnect. Not the P abort case: vLLM CPU turns chunked
prefill off for MLA, so P's 16,000-token prefill is one engine step of over a minute here, P's
running count (which that case waits on before aborting) is published only after it, and an
abort cannot interrupt it (P finishes and writes the KV, or D's ``transfer_timeout_s`` ends
first): a mid-prefill P abort does not exist for MLA on vLLM CPU. Run under
``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack.stack import Stack, StackOptions
from tests.e2e.e2e_support import module_stack
from tests.e2e.parallel_cases import CASES, EXTRA, named

pytestmark = [pytest.mark.vllm, pytest.mark.shapes]

PAIRS = [("p0", "d0"), ("p1", "d0"), ("p0", "d1"), ("p1", "d1"), ("p2", "d0")]
"""TP 1 -> 1, 2 -> 1, 1 -> 2, 2 -> 2, PP 2 -> TP 1."""
MLA_CASES = [case for case in CASES if case != "p_abort_frees_every_rank"]
"""Every case but the P abort (see the module docstring: no chunked prefill for MLA on CPU)."""
MLA_BACKENDS = ("Using CPU_MLA backend", "Using AMX_MLA backend")
"""vLLM CPU's MLA backends: AMX_MLA where the processor has AMX tiles, else CPU_MLA."""


@pytest.fixture(scope="module")
def stack(e2e_dir: Path) -> Iterator[Stack]:
    options = StackOptions(
        kind="ours",
        topology="3p2d",
        model_shape="deepseek_v2",
        tensor_parallel={"p1": 2, "d1": 2},
        pipeline_parallel={"p2": 2},
        connector_extra_config=EXTRA,
        # vLLM CPU compiles the MLA model in every worker at start-up (about 5 min for the eight
        # workers on two cores). --enforce-eager would skip it, but with it D's answers differ
        # from the reference even at TP 1 (disagg_router/connector/README.md, "Model shapes": cause
        # not found).
        startup_timeout_s=900.0,
    )
    with module_stack(options, e2e_dir) as s:
        yield s


def test_every_instance_runs_the_mla_backend(stack: Stack) -> None:
    """The model is served as MLA on every instance (else the pairs below prove nothing)."""
    for inst in stack.instances:
        log = inst.server.log_path.read_text(errors="replace")
        assert any(backend in log for backend in MLA_BACKENDS), inst.name


@pytest.mark.parametrize("case", MLA_CASES)
@pytest.mark.parametrize(("p_name", "d_name"), PAIRS)
async def test_mla_parallel_pair(stack: Stack, p_name: str, d_name: str, case: str) -> None:
    p, d = named(stack, p_name), named(stack, d_name)
    await CASES[case](stack, p, d, f"mla-par-{p_name}-{d_name}")


def test_only_p_rank_0_of_the_tp_2_p_wrote(stack: Stack) -> None:
    """After the pairs above: every WRITE of ``p1`` (P TP 2) came from its TP rank 0 (vLLM
    prefixes a worker's log lines with its ``Worker_TP<rank>``); rank 1 is a replica."""
    log = named(stack, "p1").server.log_path.read_text(errors="replace")
    writers = [line.split(" ", 1)[0] for line in log.splitlines() if "side=writer" in line]
    assert writers and set(writers) == {"(Worker_TP0"}, sorted(set(writers))
