"""``disagg-bench bind``'s arithmetic: goodput, the summary keys and the report (the runs
themselves need real vLLM)."""

from __future__ import annotations

import itertools

import pytest

from bench.binding import (
    AS_SHIPPED,
    BINDS,
    JIT_SPIN,
    PULL,
    PULL_LOADED,
    BindSpec,
    Point,
    _prompts,
    modes_in_turn,
    summarize,
)
from bench.binding_cmd import format_report


def point(bind: str, load: str, ttft: float, block_s: float, rep: int = 0) -> Point:
    return Point(
        bind=bind,
        load=load,
        rep=rep,
        rate=1.0,
        completed=4,
        failed=0,
        duration_s=4.0,
        ttft_ms=[ttft] * 4,
        tpot_ms=[10.0] * 4,
        prompt_lens=[4000] * 4,
        unwritten_block_s=block_s,
        p_wait={"p50_ms": 2.0 if bind != "eager" else 0.0},
        write={"mean_ms": 1.0},
        binds={},
        prediction_error={},
        kv_usage=[(0.0, 0.5)],
    )


def test_summary_keys_compare_the_modes_over_repetitions() -> None:
    points = [point(b, "light", 100.0, 1.0, r) for b in BINDS for r in (0, 1)]
    points += [point("eager", "loaded", 1000.0, 10.0, r) for r in (0, 1)]  # misses the TTFT SLO
    points += [point("just_in_time", "loaded", 200.0, 2.0), point("just_in_time", "loaded",
               250.0, 4.0, 1)]  # fmt: skip
    points += [point("adaptive", "loaded", 200.0, 3.0, r) for r in (0, 1)]
    data = summarize(BindSpec(input_len=4000), 5.0, points)
    assert data["slo"] == {"ttft_ms": {"4000": 300.0}, "tpot_ms": 15.0}
    keys = data["summary"]
    assert keys["d_idle_block_seconds_jit_over_eager"] == pytest.approx(0.3)
    assert keys["goodput_jit_over_eager_d_kv_bound"] is None  # eager met no SLO: no ratio
    assert keys["ttft_jit_over_eager_light"] == pytest.approx(1.0)
    assert keys["p_wait_for_d_p50_ms"] == pytest.approx(2.0)
    assert keys["goodput_adaptive_over_better_d_kv_bound"] == pytest.approx(1.0)
    cell = data["table"]["loaded/just_in_time"]
    assert (cell["low"]["unwritten_block_s"], cell["high"]["unwritten_block_s"]) == (2.0, 4.0)
    report = format_report(data)
    assert report.count("\n| loaded |") == 3 and report.count("\n| light |") == 3
    assert "`d_idle_block_seconds_jit_over_eager`: 0.3" in report
    assert keys["ttft_jit_over_pull_loaded"] is None and "`--no-pull`" in report
    assert keys["ttft_jit_spin_over_pull_loaded"] is None


def test_the_report_names_the_options_a_run_was_given() -> None:
    points = [point(b, load, 100.0, 1.0) for b in BINDS for load in ("light", "loaded")]
    data = summarize(BindSpec(input_len=4000, repetitions=4), 5.0, points)
    report = format_report(data)
    assert "disagg-bench bind --input-len 4000 --repetitions 4 --out-dir docs" in report
    data = summarize(BindSpec(), 5.0, points, pull_capacity=2.0)
    assert "disagg-bench bind --out-dir docs" in format_report(data)


def test_the_pull_comparison_puts_our_stack_as_shipped_and_spinning_beside_pull() -> None:
    points = [point(b, load, 100.0, 1.0) for b in BINDS for load in ("light", "loaded")]
    points += [point(PULL, PULL_LOADED, 800.0, 0.0, r) for r in (0, 1)]
    points += [point(JIT_SPIN, PULL_LOADED, 300.0, 1.0, r) for r in (0, 1)]
    points += [point(b, PULL_LOADED, t, 1.0, r) for b, t in (("eager", 150.0),
               ("just_in_time", 100.0)) for r in (0, 1)]  # fmt: skip
    data = summarize(BindSpec(input_len=4000), 5.0, points, pull_capacity=2.0)
    assert data["summary"]["ttft_jit_over_pull_loaded"] == pytest.approx(0.125)
    assert data["summary"]["ttft_jit_spin_over_pull_loaded"] == pytest.approx(0.375)
    assert "adaptive" not in {k.split("/")[1] for k in data["table"] if PULL_LOADED in k}
    report = format_report(data)
    assert report.count(f"\n| {PULL_LOADED} |") == 4 and report.count("\n| loaded |") == 3
    assert f"| {PULL_LOADED} | {JIT_SPIN} | 300.00 |" in report and "(2.00 requests/s)" in report


def test_a_point_counts_the_share_of_its_samples_at_which_both_ds_were_full() -> None:
    p = point("eager", "loaded", 100.0, 1.0)
    p.kv_usage = [(0.0, 0.95), (0.25, 0.5), (0.5, 0.9), (0.75, 0.2)]
    assert p.kv_full_pct() == 50.0
    p.kv_usage = []
    assert p.kv_full_pct() == 0.0
    data = summarize(BindSpec(input_len=4000), 5.0, [point(b, "light", 1.0, 1.0) for b in BINDS])
    assert data["table"]["light/eager"]["mean"]["kv_full_pct"] == 0.0  # 0.5 used: not full


def test_short_prompts_are_spread_evenly_among_the_long_and_the_warm_ups_are_long() -> None:
    spec = BindSpec(input_len=512, short_len=64, short_share=0.25, requests=8, warmups=2)
    warm, measured = _prompts(spec)
    assert [r.prompt_len for r in warm] == [512, 512]
    assert [r.prompt_len for r in measured] == [512, 512, 512, 64] * 2
    assert spec.min_prompt_tokens == 288
    assert _prompts(spec) == (warm, measured)  # the same for every stack and point
    only_long = BindSpec(input_len=512, short_share=0.0, requests=4, warmups=1)
    assert {r.prompt_len for r in _prompts(only_long)[1]} == {512}
    assert only_long.min_prompt_tokens == 0


def test_each_prompt_length_has_its_own_ttft_slo_and_the_figures_split_them() -> None:
    spec = BindSpec(input_len=4000, short_len=256)

    def mixed(bind: str, load: str, short_ttft: float) -> Point:
        p = point(bind, load, 100.0, 1.0)
        p.ttft_ms, p.prompt_lens = [100.0, 100.0, 10.0, short_ttft], [4000, 4000, 256, 256]
        return p

    points = [mixed(b, "light", 10.0) for b in BINDS]
    points += [mixed("eager", "loaded", 500.0), mixed("just_in_time", "loaded", 20.0)]
    points.append(mixed("adaptive", "loaded", 20.0))
    data = summarize(spec, 5.0, points)
    assert data["slo"]["ttft_ms"] == {"256": 30.0, "4000": 300.0}
    eager, jit = data["table"]["loaded/eager"]["mean"], data["table"]["loaded/just_in_time"]["mean"]
    assert eager["ttft_mean_ms"] == jit["ttft_mean_ms"] == 100.0  # the pushed requests only
    assert (eager["alone_ttft_p99_ms"], jit["alone_ttft_p99_ms"]) == (500.0, 20.0)
    assert (eager["goodput_rps"], jit["goodput_rps"]) == (0.75, 1.0)  # 3 and 4 of 4 in 4 s
    assert data["summary"]["goodput_jit_over_eager_d_kv_bound"] == pytest.approx(4 / 3, abs=1e-3)
    assert "3x the light eager median TTFT of the same prompt length" in format_report(data)


def test_two_repetitions_run_every_pair_of_modes_in_both_orders() -> None:
    first, second = modes_in_turn(0), modes_in_turn(1)
    assert sorted(first) == sorted(second) == sorted(BINDS)
    for a, b in itertools.combinations(BINDS, 2):
        assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b))
    as_shipped = modes_in_turn(0, AS_SHIPPED)
    assert as_shipped == modes_in_turn(1, AS_SHIPPED)[::-1] == ("eager", "just_in_time")
