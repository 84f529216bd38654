"""``disagg-bench plan``'s parts that run nothing: the workload and SLO flags, the shapes in
search order, the profile's screen, the SLO test on measured figures, the ramp left out, the
choice and the report (the runs start emulated fleets: tests/integration/bench)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from bench import plan
from bench.metrics import RequestRecord
from bench.plan import PlanSpec, Shape, Slo, Workload, figures, meets, screen, shapes
from bench.plan_cmd import add_plan_arguments, format_report
from devstack.emulator.profile import StepModel, load_profile

PROFILE = replace(
    load_profile("cpu-tiny"),
    block_size=16,
    num_blocks=101,
    max_num_seqs=64,
    max_num_batched_tokens=1000,
    step=StepModel(base_s=0.01, per_token_s=0.001, per_context_token_s=1e-5),
    request_overhead_s=0.0,
    answer_overhead_s=0.0,
)
SPEC = PlanSpec("cpu-tiny", Workload(100, 60, 2.0), Slo(500.0, 50.0), max_instances=4)


def test_the_flags_parse_into_a_workload_and_an_slo() -> None:
    assert Workload.parse("isl=4096, osl=512,rate=2.5") == Workload(4096, 512, 2.5)
    assert Slo.parse("ttft=800,tpot=25") == Slo(800.0, 25.0, 90.0)
    assert Slo.parse("ttft=800,tpot=25,percentile=99") == Slo(800.0, 25.0, 99.0)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("isl=4096,osl=512", "missing rate"),
        ("isl=4096,osl=512,rate=0", "rate: must be positive"),
        ("isl=4096,osl=x,rate=1", "osl: 'x' is not a number"),
        ("isl=4096,osl=512,rate=1,qps=3", "'qps=3'"),
        ("isl 4096", "'isl 4096'"),
    ],
)
def test_a_bad_workload_is_refused_naming_the_field(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Workload.parse(text)


def test_an_slo_percentile_above_100_is_refused() -> None:
    with pytest.raises(ValueError, match="percentile: at most 100"):
        Slo.parse("ttft=1,tpot=1,percentile=101")


def test_the_command_line_refuses_a_bad_flag_with_its_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    good = ["--profile", "cpu-tiny", "--workload", "isl=1,osl=2,rate=3", "--slo", "ttft=1,tpot=2"]
    args = parser.parse_args([*good, "--modes", "pull,push"])
    assert args.workload == Workload(1, 2, 3.0) and args.modes == ("pull", "push")
    with pytest.raises(SystemExit):
        parser.parse_args([*good, "--modes", "push,eager"])
    assert "modes: expected some of push, pull" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["--profile", "cpu-tiny", "--workload", "isl=1", "--slo", "ttft=1,tpot=2"]
        )
    assert "missing osl, rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--profile", "h100", *good[2:]])
    assert "profile 'h100': no such file, nor one of cpu-tiny, h200-" in capsys.readouterr().err


def test_shapes_come_by_instance_count_smallest_first_every_split_in_every_mode() -> None:
    found = list(shapes(replace(SPEC, modes=("push", "pull"))))
    assert [len(c) for c in found] == [2, 4, 6]
    assert found[0] == [Shape(1, 1, "push"), Shape(1, 1, "pull")]
    assert {(s.prefill, s.decode) for s in found[2]} == {(1, 3), (2, 2), (3, 1)}


def test_the_screen_divides_the_offered_work_by_what_the_profile_can_do() -> None:
    estimate = screen(Shape(2, 3, "push"), SPEC.workload, PROFILE)
    # one 100-token prefill: one step of 100 tokens, 5050 pairs (no pair cost here)
    assert estimate["p_load"] == pytest.approx(2.0 * (0.01 + 0.1) / 2)
    # a sequence holds 10 blocks of 16: 10 fit in 100 usable blocks; a step of 10 sequences at
    # 130 tokens of context: 0.01 + 0.01 + 1300e-5 s for 10 tokens
    per_d = 10 / (0.01 + 0.01 + 1300e-5)
    assert estimate["d_load"] == pytest.approx(2.0 * 60 / (3 * per_d))
    assert estimate["tpot_floor_ms"] == pytest.approx(1000 * (0.01 + 0.001 + 130e-5))
    # one request alone: its prefill, its 100 tokens' KV moved, D's first step at 100 tokens
    moved = PROFILE.transfer.seconds(100, first_meeting=False)
    floor = 1000 * (0.01 + 0.1 + moved + 0.01 + 0.001 + 100e-5)
    assert estimate["ttft_floor_ms"] == pytest.approx(floor)


def _record(ttft: float, latency: float, tokens: int = 11, ok: bool = True) -> RequestRecord:
    return RequestRecord(ok, 100, tokens if ok else 0, 0.0, ttft, latency)


def test_figures_are_the_measured_requests_percentiles_in_ms() -> None:
    records = [_record(0.1 * i, 0.1 * i + 0.2) for i in range(1, 11)]  # TPOT 20 ms each
    found = figures(records, 90.0)
    assert found["measured"] == 10 and found["failed"] == 0
    assert found["ttft_ms"] == pytest.approx(910.0) and found["ttft_p50_ms"] == pytest.approx(550)
    assert found["tpot_ms"] == pytest.approx(20.0)
    assert figures([*records, _record(0, 0, ok=False)], 90.0)["failed"] == 1


def test_a_shape_meets_the_slo_only_with_no_failure_and_both_bounds_kept() -> None:
    slo = Slo(500.0, 50.0)
    good = {"failed": 0, "ttft_ms": 500.0, "tpot_ms": 50.0}
    assert meets(good, slo)
    assert not meets({**good, "failed": 1}, slo)
    assert not meets({**good, "ttft_ms": 501.0}, slo)
    assert not meets({**good, "tpot_ms": 50.1}, slo)


def _measured(ttft: float) -> dict[str, object]:
    return {
        "measured": 8,
        "failed": 0,
        "ttft_ms": ttft,
        "tpot_ms": 20.0,
        "ttft_p50_ms": ttft,
        "tpot_p50_ms": 20.0,
    }


def test_the_search_stops_at_the_first_count_that_meets_and_runs_no_hopeless_shape(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[Shape] = []

    def run_shape(shape: Shape, *_: object) -> dict[str, object]:
        ran.append(shape)
        return _measured(600.0 if shape.prefill < 3 else 300.0 + 10 * shape.decode)

    monkeypatch.setattr(plan, "run_shape", run_shape)
    monkeypatch.setattr(plan, "load_profile", lambda _: PROFILE)
    spec = replace(SPEC, workload=Workload(100, 20, 12.0), max_instances=6)
    data = plan.run_plan(spec, tmp_path)
    # P load is 12 * 0.11 s over the Ps: 2 Ps or more; one D has room (load 0.7)
    assert [(s.prefill, s.decode) for s in ran] == [(2, 1), (2, 2), (3, 1)]
    assert [r["gpus"] for r in data["rows"]][-1] == 4
    assert data["choice"]["prefill"] == 3 and data["choice"]["ttft_ms"] == 310.0
    assert not data["rows"][0]["ran"] and data["rows"][0]["why"] == "offered load over capacity"
    report = format_report({**data, "command": "disagg-bench plan"})
    assert "**Cheapest: 3P1D, push, 4 GPUs**" in report
    assert "| 2P1D | push | 3 | 0.66 | 0.70 | 600 | 600 | 20.0 | 20.0 | 0 | misses |" in report
    assert "their queues only grow: 1P1D, 1P2D, 1P3D." in report


def test_no_shape_runs_when_one_request_alone_is_slower_than_the_ttft(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(plan, "run_shape", lambda *_: pytest.fail("ran"))
    monkeypatch.setattr(plan, "load_profile", lambda _: PROFILE)
    data = plan.run_plan(replace(SPEC, slo=Slo(100.0, 500.0), max_instances=2), tmp_path)
    assert data["choice"] is None
    assert [r["why"] for r in data["rows"]] == ["one request alone is over the TTFT"]


def test_no_shape_runs_when_one_sequence_alone_is_slower_than_the_tpot(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(plan, "run_shape", lambda *_: pytest.fail("ran"))
    monkeypatch.setattr(plan, "load_profile", lambda _: PROFILE)
    data = plan.run_plan(replace(SPEC, slo=Slo(500.0, 5.0), max_instances=3), tmp_path)
    assert data["choice"] is None and len(data["rows"]) == 3
    assert {r["why"] for r in data["rows"]} == {"one sequence's step is over the TPOT"}
    report = format_report({**data, "command": "x"})
    assert "**No shape tried meets the SLO.**" in report
    assert "Not run, one sequence's step is over the TPOT: 1P1D, 1P2D, 2P1D." in report


def _aic_disagg(tp: int, replicas: int) -> dict[str, object]:
    per_replica = {"prefill": 1, "decode": 1, "decode_batch": 28, "gpus_per_replica": 2 * tp}
    return {
        "mode": "disagg",
        "prefill_tp": tp,
        "decode_tp": tp,
        **per_replica,
        "rate_per_replica": 1.697,
        "ttft_ms": 796.4,
        "tpot_ms": 29.7,
        "replicas": replicas,
        "gpus": replicas * 2 * tp,
    }


ANSWER = {
    "estimator": "aiconfigurator 0.12.0",
    "disagg_tp": _aic_disagg(1, 3),
    "disagg": _aic_disagg(1, 3),
    "chosen": {
        "mode": "agg",
        "tp": 4,
        "batch": 64,
        "gpus_per_replica": 4,
        "rate_per_replica": 4.358,
        "replicas": 1,
        "gpus": 4,
        "ttft_ms": 331.6,
        "tpot_ms": 28.1,
    },
}


def test_the_report_puts_aiconfigurators_answer_beside_ours(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(plan, "run_shape", lambda *_: _measured(300.0))
    monkeypatch.setattr(plan, "load_profile", lambda _: PROFILE)
    data = {**plan.run_plan(SPEC, tmp_path), "command": "x", "aiconfigurator": ANSWER}
    report = format_report(data)
    assert (
        "disaggregated at TP 1: 3 x 1P1D = **6 GPUs** (TTFT 796 ms, TPOT 29.7 ms, D batch 28"
        in (report)
    )
    assert "disaggregated at any TP" not in report  # the same replica
    assert (
        "every parallelism and mode it knows: 1 x aggregated at TP 4 = 4 GPUs (TTFT 332" in report
    )
    other = {**ANSWER, "disagg_tp": None, "disagg": _aic_disagg(2, 5)}
    report = format_report({**data, "aiconfigurator": other})
    assert "no disaggregated replica at TP 1 among its top ones" in report
    assert "any TP: 5 x 1P1D (P at TP 2, D at TP 2) = 20 GPUs" in report


def test_aiconfigurator_is_asked_the_same_question_and_its_last_line_read(
    tmp_path: Path,
) -> None:
    # a stand-in for the environment's Python: prints a line of noise, then its arguments
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho \'loading tables\'\nprintf \'{"argv": "%s"}\\n\' "$*"\n')
    python.chmod(0o755)
    spec = replace(SPEC, profile="h200-qwen3-32b-tp1", gpus_per_instance=2)
    answer = plan.aiconfigurator_answer(spec, python)
    argv = answer["argv"].split()
    assert argv[0].endswith("aiconfigurator_plan.py")
    given = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert given == {
        "--model": "Qwen/Qwen3-32B",
        "--system": "h200_sxm",
        "--tp": "2",
        "--isl": "100",
        "--osl": "60",
        "--rate": "2",
        "--ttft": "500",
        "--tpot": "50",
    }
