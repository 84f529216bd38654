"""``disagg-bench fleet-binding``'s arithmetic: the offered rate, D's cut cache, the summary
keys and the report (the runs start emulated fleets: tests/integration/bench)."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from bench.fleet_binding import (
    FleetBindingSpec,
    offered_rate,
    summary_keys,
)
from bench.fleet_binding_cmd import format_report
from devstack.emulator.profile import StepModel, load_profile

PROFILE = replace(
    load_profile("cpu-tiny"),
    block_size=128,
    max_num_batched_tokens=1000,
    step=StepModel(base_s=0.01, per_token_s=0.001, per_attention_pair_s=1e-6),
    request_overhead_s=0.002,
    answer_overhead_s=0.003,
)


def test_the_offered_rate_keeps_every_p_at_its_fraction() -> None:
    spec = FleetBindingSpec(size=4, input_len=1000, loaded_fraction=0.5, short_share=0.5)
    per_p = 1 / PROFILE.prefill_seconds(1000)
    # half the requests go through P: twice P's share of them is offered
    assert offered_rate(spec, PROFILE) == pytest.approx(2 * 0.5 * 4 * per_p)


def test_ds_cache_holds_its_long_requests_and_the_null_block() -> None:
    spec = FleetBindingSpec(input_len=1000, output_len=30, d_prompts=3)
    assert spec.d_blocks(PROFILE) == 3 * 9 + 1  # 1030 tokens: 9 blocks of 128


def test_the_prompts_are_warm_up_waves_then_the_measured_mix() -> None:
    spec = FleetBindingSpec(size=3, waves=2, requests=10, input_len=1000, short_len=50)
    warm, measured = spec.prompts()
    assert [r.prompt_len for r in warm] == [1000] * 6  # one long prompt per P per wave
    assert sorted(r.prompt_len for r in measured) == [50] * 5 + [1000] * 5
    assert spec.prompts() == (warm, measured)  # the same for every mode


def mode(ttft: float, unwritten: float, p50: float = 0.0) -> dict[str, object]:
    return {
        "completed": 10,
        "failed": 0,
        "ttft_mean_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "alone_ttft_p99_ms": 5.0,
        "unwritten_block_s": unwritten,
        "p_wait": {"count": 5.0, "mean_ms": p50, "p50_ms": p50, "nonzero": 0.2},
        "binds": {"predicted": 4.0, "prefill_done": 1.0},
    }


def test_the_summary_keys_compare_the_modes_of_the_run() -> None:
    spec = FleetBindingSpec(size=4)
    modes = {"eager": mode(100.0, 80.0), "just_in_time": mode(50.0, 20.0, 1.5)}
    modes["adaptive"] = mode(60.0, 25.0)
    keys = summary_keys(spec, modes)
    assert keys == {
        "d_idle_block_seconds_jit_over_eager_4p4d_emulated": 0.25,
        "p_wait_for_d_p50_ms_4p4d_emulated": 1.5,
        "ttft_jit_over_eager_4p4d_emulated": 0.5,
        "ttft_adaptive_over_better_4p4d_emulated": 1.2,
    }


def test_the_report_names_the_command_and_a_row_per_mode() -> None:
    spec = FleetBindingSpec(size=4)
    modes = {b: mode(100.0, 10.0) for b in ("eager", "just_in_time", "adaptive")}
    data = {
        "spec": asdict(spec),
        "prefill_s": 0.5,
        "rate": 12.0,
        "d_blocks": 131,
        "modes": modes,
        "summary": summary_keys(spec, modes),
    }
    text = format_report(data)
    assert "fleet-binding --size 4 --out-dir docs/benchmarks`" in text
    assert "| just_in_time | 10 | 0 | 100.0 | 200.0 | 5.0 | 10.0 | 0.00 | 20.0 |" in text
    assert "`ttft_jit_over_eager_4p4d_emulated`: 1.0" in text
