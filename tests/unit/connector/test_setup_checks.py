"""Start-up refusals of unsupported vLLM setups, and registration refusals both sides log."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer_state import ConsumerState
from disagg_router.connector.errors import UnsupportedSetupError
from disagg_router.connector.layout import LayoutSpec
from disagg_router.connector.producer_state import ProducerState
from disagg_router.connector.protocol import decode_request, registration_from_body
from disagg_router.connector.setup_checks import connector_kv_heads, refuse_unsupported
from disagg_router.connector.specs import RecvSpec
from tests.unit.connector.core_support import LAYOUT, FakeClock


def vllm_config(tp: int = 1, pp: int = 1, mla: bool = False, role: str = "kv_producer") -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(use_mla=mla),
        kv_transfer_config=SimpleNamespace(kv_role=role),
    )


def kv_cache_config(groups: int = 1) -> Any:
    return SimpleNamespace(kv_cache_groups=[object()] * groups)


def test_a_plain_single_worker_setup_passes() -> None:
    refuse_unsupported(vllm_config(), kv_cache_config())
    refuse_unsupported(vllm_config(), None)  # a role that has no KV cache config yet


def test_an_mla_model_with_one_worker_passes() -> None:
    """One latent KV tensor per layer is a region like any other (tests/e2e/
    test_connector_mla_parallel_e2e moves a DeepSeek-V2-shaped model's KV on real vLLM CPU)."""
    refuse_unsupported(vllm_config(mla=True), kv_cache_config())


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_mla_model_with_tensor_parallel_passes(role: str) -> None:
    """Every TP rank holds the whole latent cache: one KV head, replicated (P rank 0 is the one
    source; tests/e2e/test_connector_mla_parallel_e2e runs it on real vLLM CPU)."""
    refuse_unsupported(vllm_config(tp=2, mla=True, role=role), kv_cache_config())


def test_an_mla_model_on_a_pipeline_parallel_p_passes() -> None:
    """Each stage writes its own layers' latent blocks (tests/e2e/
    test_connector_mla_parallel_e2e runs P PP 2 -> D TP 1 on real vLLM CPU)."""
    refuse_unsupported(vllm_config(pp=2, mla=True), kv_cache_config())
    refuse_unsupported(vllm_config(tp=2, pp=2, mla=True), None)


def test_an_mla_model_counts_one_kv_head_for_the_layout() -> None:
    """vLLM's total KV head count of an MLA model is not what its ranks hold: each holds the
    whole latent cache, so the worker's layout states 1 head (replicated on every rank)."""
    mla = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 16)
    gqa = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 8)
    assert (connector_kv_heads(mla), connector_kv_heads(gqa)) == (1, 8)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_tensor_parallel_is_allowed_on_p_and_d(role: str) -> None:
    refuse_unsupported(vllm_config(tp=2, role=role), kv_cache_config())
    refuse_unsupported(vllm_config(tp=8, role=role), None)


def test_pipeline_parallel_is_allowed_on_p_only() -> None:
    """Each stage of P writes its own layers into D's regions of the same layers."""
    refuse_unsupported(vllm_config(pp=2), kv_cache_config())
    refuse_unsupported(vllm_config(tp=2, pp=2), None)


@pytest.mark.parametrize(
    ("config", "groups", "reason"),
    [
        (vllm_config(pp=4, role="kv_consumer"), 1, "pipeline_parallel_size=4 with kv_role"),
        (vllm_config(pp=2, role="kv_both"), 1, "pipeline parallel size must be 1 on D"),
        (vllm_config(), 2, "2 KV cache groups: .* does not implement SupportsHMA"),
    ],
)
def test_unsupported_setups_fail_at_start_up_naming_the_setting(
    config: Any, groups: int, reason: str
) -> None:
    with pytest.raises(UnsupportedSetupError, match=reason):
        refuse_unsupported(config, kv_cache_config(groups))


def test_a_mismatched_layout_is_refused_and_both_sides_log_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    p_layout = LayoutSpec(LAYOUT.regions, dtype="bfloat16", block_size=16)
    d_layout = LayoutSpec(LAYOUT.regions, dtype="bfloat16", block_size=32)
    p = ProducerState("p0", p_layout, ConnectorConfig(), clock)
    d = ConsumerState(ConnectorConfig(), d_layout, "d-agent", b"meta", clock)
    [ask] = d.register(RecvSpec("d-1", "k1", "p0", "10.0.0.1", 5600, (1,), first_block=0))
    caplog.set_level(logging.WARNING, logger="disagg_router.connector")
    reply = p.register(registration_from_body(decode_request(ask.payload)[1]))
    d.answer(ask, reply)
    why = "incompatible KV layout: block size (tokens) differs: 32 vs 16"
    assert reply.status == "failed" and reply.reason == why
    logged = [r.getMessage() for r in caplog.records]
    assert any("refused registration of k1" in m and why in m for m in logged)  # P
    assert any("transfer k1 for d-1 failed: P refused: " + why in m for m in logged)  # D
    assert d.take_results() == ({"d-1"}, {"d-1"})
