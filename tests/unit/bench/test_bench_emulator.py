"""The emulator benchmarks' arithmetic: the profile fit's rows and its non-negative least
squares, the accuracy comparison's point and ratio errors, the fleet-scale pooling."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Any

import pytest

from bench.churn import Churn, ChurnSpec, Outcome, churn_result
from bench.emulated_stack import twin_cores
from bench.emulator_accuracy import (
    capacity_errors,
    mean_rows,
    point_errors,
    ratio_errors,
    repeat_errors,
)
from bench.emulator_accuracy_cmd import (
    add_emulator_accuracy_arguments,
    emulator_accuracy_command,
    format_report,
)
from bench.fleet_scale import pooled_runs
from bench.profile_fit import decode_row, fit_estimates, nnls, predicted, prefill_row
from bench.profile_fit_cmd import format_report as format_fit_report
from bench.scenarios import SweepSpec
from devstack.emulator import load_profile
from devstack.stack import DECODE_CORE, PREFILL_CORE

pytest.importorskip("numpy")


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks() -> None:
    row = prefill_row(5000, 2048, 0.1)
    assert (row.steps, row.tokens, row.seqs) == (3, 5000, 3)
    # chunk i attends to itself and everything before it
    pairs = sum(n * done + n * (n + 1) // 2 for n, done in ((2048, 0), (2048, 2048), (904, 4096)))
    assert row.pairs == pairs
    assert (row.request, row.answer) == (1, 0)
    assert prefill_row(5000, 2048, 0.1, answer=True).answer == 1


def test_a_decode_row_is_one_step_of_the_batch() -> None:
    row = decode_row(8, 1000.0, 0.004)
    assert (row.steps, row.tokens, row.seqs, row.context, row.request) == (1, 8, 8, 8000, 0)


def test_the_fit_recovers_known_coefficients_and_never_goes_negative() -> None:
    truth = [0.002, 3e-6, 4e-5, 1e-8, 2e-9, 0.003, 0.004]
    lengths = (64, 256, 1024, 2048, 4096, 8192)
    rows = [prefill_row(n, 2048, 0.0, answer) for n in lengths for answer in (False, True)]
    rows += [decode_row(b, c, 0.0) for b in (1, 4, 16, 32) for c in (160.0, 2080.0)]
    rows = [r.__class__(**{**vars(r), "seconds": predicted(r, truth)}) for r in rows]
    fitted = nnls(rows)
    for got, want in zip(fitted, truth, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    # a row set that would want a negative coefficient gets it pinned at zero
    skewed = [
        r.__class__(**{**vars(r), "seconds": r.seconds * (2 if r.request else 1)}) for r in rows
    ]
    assert min(nnls(skewed)) >= 0.0


def _row(
    stack: str,
    length: int,
    fraction: float,
    ttft: float,
    tpot: float,
    alone: tuple[float, float] | None = None,
) -> dict[str, object]:
    metrics = {"mean_ttft_ms": ttft, "mean_tpot_ms": tpot}
    row: dict[str, object] = {
        "stack": stack,
        "input_len": length,
        "fraction": fraction,
        "rep": 0,
        "metrics": metrics,
    }
    if alone is not None:
        row["alone"] = {"ttft_ms": alone[0], "tpot_ms": alone[1]}
    return row


def test_points_and_ratios_compare_the_emulated_run_with_the_real_one() -> None:
    real = [
        _row("ours", 512, 0.3, 100.0, 2.0),
        _row("ours", 512, 0.9, 200.0, 4.0),
        _row("aggregated", 512, 0.3, 50.0, 2.0),
    ]
    emulated = [
        _row("ours", 512, 0.3, 110.0, 2.0),
        _row("ours", 512, 0.9, 180.0, 5.0),
        _row("aggregated", 512, 0.3, 55.0, 1.0),
    ]
    points = point_errors(real, emulated)
    first = points[0]
    assert first["error_mean_ttft_ms"] == pytest.approx(0.1)
    assert points[1]["error_mean_tpot_ms"] == pytest.approx(0.25)
    ratios = {r["ratio"]: r for r in ratio_errors(points, SweepSpec(fractions=(0.3, 0.9)))}
    loaded = ratios["ours TTFT loaded/light at 512"]
    assert (loaded["real"], loaded["emulated"]) == pytest.approx((2.0, 180 / 110))
    assert ratios["TTFT ours/aggregated at 512, 0.3"]["error"] == pytest.approx(0.0)


def test_each_run_s_requests_alone_before_a_point_are_kept_beside_it() -> None:
    real = [_row("ours", 512, 0.9, 300.0, 6.0, alone=(100.0, 3.0))]
    emulated = [_row("ours", 512, 0.9, 150.0, 2.0, alone=(50.0, 1.5))]
    [point] = point_errors(real, emulated)
    assert point["error_mean_ttft_ms"] == pytest.approx(-0.5)
    assert (point["real_alone_mean_ttft_ms"], point["emulated_alone_mean_ttft_ms"]) == (100, 50)
    assert (point["real_alone_mean_tpot_ms"], point["emulated_alone_mean_tpot_ms"]) == (3, 1.5)
    [untimed] = point_errors([_row("ours", 512, 0.9, 300.0, 6.0)], emulated)
    assert untimed["real_alone_mean_tpot_ms"] is None


def test_a_point_missing_from_one_run_is_left_out() -> None:
    real = [_row("ours", 512, 0.3, 100.0, 2.0), _row("ours", 2048, 0.3, 100.0, 2.0)]
    assert [p["input_len"] for p in point_errors(real, real[:1])] == [512]


def test_real_runs_are_averaged_per_point_present_in_all() -> None:
    first = [
        _row("ours", 512, 0.3, 100.0, 2.0, alone=(10.0, 1.0)),
        _row("ours", 2048, 0.3, 300.0, 3.0),
    ]
    second = [_row("ours", 512, 0.3, 120.0, 3.0, alone=(20.0, 2.0))]
    [only] = mean_rows([first, second])
    assert only["input_len"] == 512
    assert only["metrics"] == {"mean_ttft_ms": 110.0, "mean_tpot_ms": 2.5}
    assert only["alone"] == {"ttft_ms": 15.0, "tpot_ms": 1.5}
    [no_alone] = mean_rows([first[1:], [_row("ours", 2048, 0.3, 100.0, 1.0, (1.0, 1.0))]])
    assert no_alone["alone"] == {}
    assert mean_rows([first]) == first


def test_later_real_runs_are_measured_against_the_first() -> None:
    spec = SweepSpec(fractions=(0.3, 0.9))
    first = [_row("ours", 512, 0.3, 100.0, 2.0), _row("ours", 512, 0.9, 200.0, 4.0)]
    second = [_row("ours", 512, 0.3, 100.0, 2.5), _row("ours", 512, 0.9, 300.0, 4.0)]
    repeats = repeat_errors([first, second], spec)
    assert [p["error_mean_tpot_ms"] for p in repeats["points"]] == pytest.approx([0.25, 0.0])
    [ratio] = repeats["ratios"]
    assert (ratio["real"], ratio["emulated"]) == pytest.approx((2.0, 3.0))
    assert repeat_errors([first], spec) == {"points": [], "ratios": []}


def test_the_report_shows_the_real_runs_against_each_other() -> None:
    spec = SweepSpec(fractions=(0.3, 0.9))
    first = [_row("ours", 512, 0.3, 100.0, 2.0), _row("ours", 512, 0.9, 200.0, 4.0)]
    second = [_row("ours", 512, 0.3, 100.0, 2.5), _row("ours", 512, 0.9, 300.0, 4.0)]
    points = point_errors(mean_rows([first, second]), first)
    data = {
        "command": "disagg-bench emulator-accuracy --real-runs 2",
        "real_runs": 2,
        "points": points,
        "ratios": ratio_errors(points, spec),
        "repeats": repeat_errors([first, second], spec),
        "capacities": [],
        "summary": {},
    }
    report = format_report(data)
    assert "The real sweep ran 2 times" in report
    assert "alone on idle instances" not in report  # no point timed a request alone
    assert "| ours | 512 | 0.3 | 100.0 / 100.0 (+0 %) | 2.00 / 2.50 (+25 %) |" in report
    assert "| ours TTFT loaded/light at 512 | 2.000 | 3.000 | +50 % |" in report
    data["repeats"] = {"points": [], "ratios": []}
    assert "The real sweep ran" not in format_report(data)
    assert "The twins slept through their steps" in report
    data["cpu_steps"] = True
    assert "spent their steps as CPU time on their real twins' cores" in format_report(data)
    data["fit"] = {"profile": {"work_rate": 201234.4}, "rows": [{"error": 0.1}]}
    fitted = format_report(data)
    assert "spent their steps as work (the profile's 201234 pieces per second" in fitted
    data["fit"] = {"profile": {"work_rate": None}, "rows": [{"error": 0.1}]}
    assert "spent their steps as CPU time" in format_report(data)
    del data["fit"]
    assert "Twins that slept" not in report
    data["sleeping"] = {"points": points[1:], "ratios": []}
    with_sleeping = format_report(data)
    assert "Twins that slept through their steps" in with_sleeping
    assert "| stack | input | x capacity | TTFT ms real / sleeping (error) |" in with_sleeping


def test_cpu_steps_without_pinned_processes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_emulator_accuracy_arguments(parser)
    args = parser.parse_args(["--cpu-steps", "--out-dir", "unused"])
    assert emulator_accuracy_command(args) == 2
    assert "--cpu-steps needs --pin-processes" in capsys.readouterr().err
    args = parser.parse_args(["--also-sleeping", "--pin-processes", "--out-dir", "unused"])
    assert emulator_accuracy_command(args) == 2
    assert "--also-sleeping needs --cpu-steps" in capsys.readouterr().err


def test_fleet_scale_pools_the_cpu_of_both_runs_of_a_size() -> None:
    runs = [
        {
            "router_cpu_s": 1.0,
            "completed": 400,
            "failed": 0,
            "router_cpu_ms_per_request": 2.5,
            "router_rss_mib": 500.0,
            "indexed_blocks": 10,
            "mean_ttft_ms": 30.0,
        },
        {
            "router_cpu_s": 1.4,
            "completed": 400,
            "failed": 1,
            "router_cpu_ms_per_request": 3.5,
            "router_rss_mib": 510.0,
            "indexed_blocks": 12,
            "mean_ttft_ms": 40.0,
        },
    ]
    pooled = pooled_runs(runs)
    assert pooled["router_cpu_ms_per_request"] == pytest.approx(3.0)
    assert (pooled["completed"], pooled["failed"], pooled["indexed_blocks"]) == (800, 1, 12)
    assert pooled["router_rss_mib"] == 510.0


def test_capacities_are_compared_per_stack_and_input_length() -> None:
    real = [
        {"stack": "ours", "input_len": 512, "request_throughput": 20.0},
        {"stack": "ours", "input_len": 2048, "request_throughput": 10.0},
    ]
    emulated = [{"stack": "ours", "input_len": 512, "request_throughput": 25.0}]
    [only] = capacity_errors(real, emulated)
    assert (only["input_len"], only["error"]) == (512, pytest.approx(0.25))


def test_a_gpu_profile_is_fitted_to_estimator_rows() -> None:
    truth = [0.018, 6e-5, 0.0, 5e-8, 1.2e-8, 0.0, 0.0]
    rows = [
        {"kind": "prefill", "length": n, "seconds": predicted(prefill_row(n, 8192, 0.0), truth)}
        for n in (128, 1024, 4096, 8192)
    ] + [
        {
            "kind": "decode",
            "batch": b,
            "context": c,
            "seconds": predicted(decode_row(b, c, 0.0), truth),
        }
        for b in (1, 32, 128)
        for c in (1024, 16384)
    ]
    estimates = {"model": "m", "max_num_batched_tokens": 8192, "kv_bytes_per_token": 262144}
    fitted = fit_estimates({**estimates, "rows": rows}, "gpu", kv_cache_gb=61.0)
    profile = fitted["profile"]
    assert profile.step.base_s == pytest.approx(0.018, rel=1e-6)
    assert profile.step.per_attention_pair_s == pytest.approx(1.2e-8, rel=1e-6)
    assert profile.num_blocks == int(61e9 // (262144 * 128))
    assert profile.transfer.bytes_per_token == 262144
    assert all(abs(r["error"]) < 1e-6 for r in fitted["rows"])


def test_churn_counts_only_failures_no_killed_instance_explains() -> None:
    outcomes = [
        Outcome(True, "a"),
        Outcome(False, "b", "stream ended without [DONE]"),
        Outcome(False, "c", "status 502"),
        Outcome(False, None, "ConnectError"),
    ]
    churn = Churn(killed=[("d1", ["b", "x"]), ("p2", [])], joined=["d4"])
    result = churn_result(ChurnSpec(seconds=1.0), outcomes, churn)
    assert (result["requests"], result["completed"]) == (4, 1)
    assert result["failed_on_killed_instances"] == 1
    assert result["summary"]["churn_failed_requests"] == 2
    assert [o["request_id"] for o in result["unexplained"]] == ["c", None]
    assert (result["kills"], result["joins"], result["requests_in_flight_at_kills"]) == (2, 1, 2)


def test_the_report_shows_the_requests_alone_before_each_point() -> None:
    real = [_row("ours", 512, 0.9, 300.0, 6.0, alone=(100.0, 3.0))]
    emulated = [_row("ours", 512, 0.9, 150.0, 2.0, alone=(50.0, 1.5))]
    data = {
        "command": "disagg-bench emulator-accuracy",
        "points": point_errors(real, emulated),
        "ratios": [],
        "capacities": [],
        "summary": {},
    }
    assert "| ours | 512 | 0.9 | 100.0 / 50.0 | 3.00 / 1.50 |" in format_report(data)


def test_pinned_twins_spend_their_steps_on_their_real_twins_cores() -> None:
    # sleeping twins: the emulator on P's core, no engine on a core of its own
    assert twin_cores(aggregated=False, cpu_steps=False) == (PREFILL_CORE, ())
    assert twin_cores(aggregated=True, cpu_steps=False) == (PREFILL_CORE, ())
    # P's and D's steps on P's and D's cores; the HTTP work beside D's decode steps
    assert twin_cores(aggregated=False, cpu_steps=True) == (
        DECODE_CORE,
        (PREFILL_CORE, DECODE_CORE),
    )
    # an aggregated engine on P's core as the real one is; the HTTP work off it
    assert twin_cores(aggregated=True, cpu_steps=True) == (DECODE_CORE, (PREFILL_CORE,))


def test_a_cpu_fit_report_gives_the_machine_speed_it_was_fitted_at() -> None:
    profile = asdict(replace(load_profile("cpu-tiny"), work_rate=198765.0))
    row = {"label": "prefill 64", "seconds": 0.01, "fitted_s": 0.011, "error": 0.1}
    data: dict[str, Any] = {"command": "fit-profile", "profile": profile, "rows": [row]}
    report = format_fit_report(data)
    assert "(`work_rate`): 198765 pieces of work per CPU second" in report
    assert "| prefill 64 | 10.00 | 11.00 | +10 % |" in report
    data["profile"] = {**profile, "work_rate": None}
    assert "work_rate" not in format_fit_report(data)
