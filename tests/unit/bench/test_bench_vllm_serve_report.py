"""``disagg-bench vllm-serve``: reading ``vllm bench serve``'s result JSON, ratios, the report,
the client's command line and the command's flags (no processes started)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main
from bench.client import Target
from bench.scenarios import InstanceGroup
from bench.vllm_serve import ClientRun, ServeRecipe, run_serve_benchmark
from bench.vllm_serve_report import (
    REPORTED,
    build_report,
    failed_point,
    point_from_result,
    ratios,
    read_disagg_bench,
    render_markdown,
    trim_result,
)

#: What vLLM 0.32's ``vllm bench serve --save-result --save-detailed`` wrote in a real run
#: (``disagg-bench vllm-serve`` against the ``ours`` stack), per-request lists cut to 3 entries.
RESULT = Path(__file__).parent / "data" / "vllm_bench_serve_result.json"


def _result(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RESULT.read_text())
    return {**data, **changes}


def test_point_reads_the_statistics_vllm_writes() -> None:
    data = _result()
    row = point_from_result("ours", 1.0, data)
    assert row["completed"] == data["completed"] and row["failed"] == data["failed"]
    for key in REPORTED:
        assert row[key] == data[key]
    assert row["p90_itl_ms"] == data["p90_itl_ms"] and row["std_e2el_ms"] == data["std_e2el_ms"]
    assert row["duration"] == data["duration"]
    assert row["output_lens"] == {"min": min(data["output_lens"]), "max": max(data["output_lens"])}
    assert row["errors"] == []  # vLLM writes "" for a request without error


def test_point_keeps_first_errors_and_survives_a_trimmed_result() -> None:
    row = point_from_result("pull", 2.0, _result(errors=["", "boom", "b2", "b3", "b4"]))
    assert row["errors"] == ["boom", "b2", "b3"]
    trimmed = trim_result(_result())
    row = point_from_result("pull", 2.0, trimmed)
    assert row["output_lens"] is None and row["errors"] == []
    assert row["mean_ttft_ms"] == _result()["mean_ttft_ms"]


def test_trim_drops_per_request_lists_and_local_paths() -> None:
    trimmed = trim_result(_result(tokenizer_id="/some/where/tiny-model"))
    for key in ("ttfts", "itls", "generated_texts", "errors", "output_lens", "start_times"):
        assert key not in trimmed
    assert trimmed["tokenizer_id"] == "tiny-model"
    assert trimmed["model_id"] == _result()["model_id"] and trimmed["completed"] > 0


def _point(stack: str, rate: float, ttft: float, tpot: float) -> dict[str, Any]:
    data = _result(mean_ttft_ms=ttft, median_ttft_ms=ttft, p99_ttft_ms=2 * ttft)
    data.update(mean_tpot_ms=tpot, median_tpot_ms=tpot, p99_tpot_ms=tpot)
    return point_from_result(stack, rate, data)


def test_ratios_per_rate_over_the_stacks_that_ran_there() -> None:
    points = [
        _point("ours", 1, 100, 10),
        _point("pull", 1, 400, 20),
        _point("vllm-push", 1, 200, 0),
        _point("ours", 2, 150, 10),
        _point("vllm-push", 2, 300, 5),
        failed_point("pull", 2, "client exited with 1"),
    ]
    table = ratios(points)
    assert table["ours_over_pull"]["1"]["mean_ttft_ms"] == pytest.approx(0.25)
    assert table["ours_over_pull"]["1"]["p99_ttft_ms"] == pytest.approx(0.25)
    assert table["ours_over_pull"]["1"]["mean_tpot_ms"] == pytest.approx(0.5)
    assert table["ours_over_pull"]["2"]["mean_ttft_ms"] is None  # pull's run wrote nothing
    assert table["ours_over_vllm_push"]["1"]["mean_tpot_ms"] is None  # zero denominator
    assert table["ours_over_vllm_push"]["2"]["median_ttft_ms"] == pytest.approx(0.5)
    assert ratios([_point("ours", 1, 1, 1)]) == {"ours_over_pull": {}, "ours_over_vllm_push": {}}


def _disagg_dir(tmp_path: Path) -> Path:
    summary = {
        "ttft_push_over_pull_loaded": 0.257,
        "tpot_push_over_pull_loaded": 0.329,
        "ttft_ours_over_vllm_push_loaded": None,
        "spread": {"ttft_push_over_pull_loaded": {"low": 0.25, "high": 0.26}},
        "load_points": {"light_fraction": 0.3, "loaded_fraction": 0.9},
        "measured_at": "2026-12-01",
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    sweep = {"sweep": {"input_lens": [512, 8192, 2048], "output_len": 64}}
    (tmp_path / "scenarios.json").write_text(json.dumps(sweep))
    return tmp_path


def test_disagg_bench_keys_and_their_point(tmp_path: Path) -> None:
    disagg = read_disagg_bench(_disagg_dir(tmp_path))
    assert disagg is not None
    assert disagg["keys"]["ttft_push_over_pull_loaded"] == {
        "value": 0.257,
        "spread": {"low": 0.25, "high": 0.26},
    }
    assert disagg["keys"]["ttft_ours_over_vllm_push_loaded"]["value"] is None
    assert (disagg["input_len"], disagg["output_len"], disagg["loaded_fraction"]) == (8192, 64, 0.9)
    assert read_disagg_bench(tmp_path / "absent") is None


def _run() -> dict[str, Any]:
    return {
        "command": "disagg-bench vllm-serve --num-prompts 5",
        "measured_at": "2026-12-02T06:00:00Z",
        "machine": {"cores": 2, "cpu_model": "cpu"},
        "vllm_version": "0.32.0",
        "recipe": {**asdict(ServeRecipe()), "rates": [1.0, 2.0]},
        "points": [
            _point("ours", 1, 100, 10),
            _point("pull", 1, 400, 20),
            _point("ours", 2, 150, 10),
            failed_point("pull", 2, "client ran past 900 s"),
        ],
        "errors": {"vllm-push": "RuntimeError: warm-up failed"},
    }


def test_markdown_puts_disagg_bench_ratios_beside_ours(tmp_path: Path) -> None:
    report = build_report(_run(), read_disagg_bench(_disagg_dir(tmp_path)))
    text = render_markdown(report)
    lines = text.splitlines()
    ttft_pull = next(x for x in lines if x.startswith("| ours / pull | TTFT mean |"))
    assert ttft_pull == (
        "| ours / pull | TTFT mean | 0.25 | - | 0.26 (`ttft_push_over_pull_loaded`, 0.25-0.26) |"
    )
    tpot_pull = next(x for x in lines if x.startswith("| ours / pull | TPOT mean |"))
    assert tpot_pull.endswith("| 0.33 (`tpot_push_over_pull_loaded`) |")
    push = next(x for x in lines if x.startswith("| ours / vLLM push | TTFT mean |"))
    assert push.endswith("| - (`ttft_ours_over_vllm_push_loaded`) |")
    assert "8192-token prompts, 64 output tokens, each stack at 0.9" in text
    assert "| ours | 1 | 5 / 0 |" in text
    assert "- vllm-push: RuntimeError: warm-up failed" in text
    assert "- pull at 2 req/s: client ran past 900 s" in text
    assert "2048 input / 128 output tokens" in text and "at 1, 2 req/s" in text


def test_render_only_rewrites_the_report_from_results_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(_run()))
    (tmp_path / "bench").mkdir()
    disagg = _disagg_dir(tmp_path / "bench")
    argv = ["vllm-serve", "--render-only", "--out-dir", str(out), "--disagg-bench-dir"]
    assert main([*argv, str(disagg)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["ratios"]["ours_over_pull"]["1"]["mean_ttft_ms"] == pytest.approx(0.25)
    assert report["disagg_bench"]["keys"]["tpot_push_over_pull_loaded"]["value"] == 0.329
    assert "ours / pull" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    "flags", [["--stacks", "ours,aggregated"], ["--rates", "1,-2"], ["--num-prompts", "0"]]
)
def test_bad_flags_exit_2_before_starting_anything(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["vllm-serve", *flags, "--out-dir", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_client_command_line_is_the_recipe() -> None:
    target = Target("http://127.0.0.1:9", "tiny")
    run = ClientRun("pull", target, Path("model"), 4.0, 7, Path("res") / "pull_rate4.json")
    argv = run.argv(ServeRecipe())
    assert argv[1] == "-c" and "vllm.benchmarks.serve" in argv[2]
    joined = " ".join(argv[3:])
    for part in (
        "--backend openai-chat --endpoint /v1/chat/completions",
        "--base-url http://127.0.0.1:9 --model tiny --tokenizer model",
        "--dataset-name random --random-input-len 2048 --random-output-len 128 --ignore-eos",
        "--num-prompts 100 --request-rate 4 --temperature 0 --seed 7",
        "--result-dir res --result-filename pull_rate4.json",
        "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99",
        "--save-result --save-detailed",
    ):
        assert part in joined


def test_a_stack_that_fails_to_start_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    started: list[str] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        started.append(group.kind)
        raise RuntimeError(f"no vLLM for {group.kind}")

    recipe = ServeRecipe(num_prompts=1, rates=(1.0,))
    result = run_serve_benchmark(recipe, ("ours", "pull", "vllm-push"), tmp_path, tmp_path, start)
    assert started == ["ours", "vllm-pull", "vllm-push"]
    assert result["points"] == []
    assert result["errors"]["pull"] == "RuntimeError: no vLLM for vllm-pull"
    assert set(result["errors"]) == {"ours", "pull", "vllm-push"}


def test_a_burst_caps_the_client_in_flight_and_the_default_does_not() -> None:
    target = Target("http://127.0.0.1:9", "tiny")
    run = ClientRun("ours", target, Path("model"), float("inf"), 0, Path("res") / "x.json")
    burst = " ".join(run.argv(ServeRecipe(max_concurrency=128, num_prompts=384)))
    assert "--num-prompts 384 --request-rate inf" in burst
    assert burst.endswith("--max-concurrency 128")
    assert "--max-concurrency" not in run.argv(ServeRecipe())
    with pytest.raises(ValueError, match="max_concurrency"):
        ServeRecipe(max_concurrency=0)


def test_the_report_lists_the_router_stages_and_process_cores_of_watched_points() -> None:
    row = {
        **point_from_result("ours", float("inf"), json.loads(RESULT.read_text())),
        "router_stages_ms": {"accept_to_legs_sent": 108.04, "prefill": 50.0},
        "processes": {
            "router": {
                "cpu_s": 3.0,
                "cores": 0.5,
                "cpu_ms_per_request": 7.81,
                "main_thread_wait_share": 0.4,
            },
            "prefill": {"cpu_s": 6.0, "cores": 1.0, "cpu_ms_per_request": 15.6},
        },
    }
    recipe = {**asdict(ServeRecipe(max_concurrency=128)), "rates": [float("inf")]}
    report = build_report({"recipe": recipe, "points": [row], "errors": {}}, None)
    text = render_markdown(report)
    assert "at inf req/s, at most 128 in flight." in text
    row_line = "| ours | inf | 108.0 / 50.0 / - | 0.50 (7.8); 0.40 | 1.00 (15.6); - | - (-); - |"
    assert row_line in text
