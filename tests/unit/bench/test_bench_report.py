"""Report: headline points and ratios from hand-made rows, markdown and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.overhead import derive
from bench.report import (
    Ratio,
    breakdown_table,
    headline_point,
    markdown_table,
    pair_ratio,
    render,
)
from bench.results import log_folder, recorded_command, run_in_work_dir
from devstack.process import ProcessStartError


def _row(
    stack: str,
    input_len: int,
    fraction: float,
    ttft: float,
    tpot: float,
    failed: int = 0,
    rep: int = 0,
) -> dict[str, Any]:
    metrics = {
        "completed": 5,
        "failed": failed,
        "mean_ttft_ms": ttft,
        "mean_ttft_counted_ms": ttft,
        "p99_ttft_counted_ms": ttft * 2,
        "mean_tpot_ms": tpot,
    }
    return {
        "stack": stack,
        "input_len": input_len,
        "fraction": fraction,
        "rep": rep,
        "rate": fraction * 2,
        "metrics": metrics,
    }


ROWS = [
    _row("ours", 512, 0.9, 100.0, 10.0),
    _row("pull", 512, 0.9, 120.0, 11.0),
    _row("ours", 2048, 0.3, 200.0, 10.0),
    _row("pull", 2048, 0.3, 300.0, 12.0),
    _row("ours", 2048, 0.9, 400.0, 20.0),
    _row("pull", 2048, 0.9, 1600.0, 40.0),
    _row("ours", 2048, 0.9, 600.0, 20.0, rep=1),
    _row("pull", 2048, 0.9, 1200.0, 40.0, rep=1),
    _row("ours", 2048, 1.2, 900.0, 30.0),
    _row("pull", 2048, 1.2, 5000.0, 50.0, failed=2),
    _row("aggregated", 2048, 0.3, 160.0, 9.0),
    _row("ours-spin", 2048, 0.9, 800.0, 25.0),
]
SWEEP = {"light_fraction": 0.3, "loaded_fraction": 0.9}


def test_headline_point_is_the_longest_input_both_ran_at_the_fraction() -> None:
    assert headline_point(ROWS, "ours", "pull", 0.9) == 2048
    assert headline_point(ROWS, "ours", "pull", 0.6) is None
    assert headline_point(ROWS, "ours", "vllm-push", 0.9) is None


def test_ratio_pairs_repetitions_and_reports_their_spread() -> None:
    found, why = pair_ratio(ROWS, "ours", "pull", "mean_ttft_counted_ms", 0.9)
    assert found is not None
    assert found.value == pytest.approx(500 / 1400)
    assert (found.low, found.high) == (pytest.approx(0.25), pytest.approx(0.5))
    assert found.repetitions == 2 and not found.wider_than_gap
    assert "2 repetition(s)" in why
    wide = Ratio(0.95, 0.8, 1.1, 2)
    assert wide.wider_than_gap


def test_spread_wider_than_the_gap_is_said() -> None:
    rows = [
        _row("ours", 8192, 0.9, 900.0, 5.0),
        _row("pull", 8192, 0.9, 1000.0, 5.0),
        _row("ours", 8192, 0.9, 1100.0, 5.0, rep=1),
        _row("pull", 8192, 0.9, 1000.0, 5.0, rep=1),
    ]
    _, why = pair_ratio(rows, "ours", "pull", "mean_ttft_counted_ms", 0.9)
    assert "no difference this run can claim" in why


def test_render_writes_summary_table_and_plots(tmp_path: Path) -> None:
    caps = [{"stack": "ours", "input_len": 2048, "request_throughput": 2.0}]
    scen = {
        "rows": ROWS,
        "capacities": caps,
        "sweep": SWEEP,
        "stacks": ["ours", "pull", "aggregated"],
        "errors": {},
    }
    (tmp_path / "scenarios.json").write_text(json.dumps(scen))
    (tmp_path / "transfer.json").write_text(json.dumps({"connector_over_bare_throughput": 0.9}))
    summary = render(tmp_path, "disagg-bench scenarios")
    assert summary["ttft_push_over_pull_loaded"] == pytest.approx(500 / 1400)
    assert summary["spread"]["ttft_push_over_pull_loaded"]["repetitions"] == 2
    assert summary["tpot_push_over_pull_loaded"] == pytest.approx(0.5)
    assert summary["ttft_push_over_aggregated_light"] == pytest.approx(200 / 160)
    assert summary["ttft_ours_over_vllm_push_loaded"] is None
    assert summary["ttft_push_spin_over_pull_loaded"] == pytest.approx(800 / 1600)
    assert summary["ttft_push_spin_over_push_loaded"] == pytest.approx(2.0)
    assert summary["router_added_ms_p50"] is None
    assert summary["connector_over_bare_nixl_throughput"] == pytest.approx(0.9)
    assert summary["capacity_rps"] == {"ours": {"2048": 2.0}}
    assert summary["load_points"] == {"light_fraction": 0.3, "loaded_fraction": 0.9}
    pull_points = summary["points"]["pull"]
    assert {
        "input_len": 2048,
        "fraction": 1.2,
        "rep": 0,
        "rate": 2.4,
        "completed": 5,
        "failed": 2,
    } in pull_points
    assert summary["machine"]["cores"] >= 1
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert set(on_disk) >= {"measured_at", "machine", "vllm_router_added_ms_p50", "spread"}
    md = (tmp_path / "results.md").read_text()
    assert "no point at 0.9 x capacity that both ours and vllm-push ran" in md
    assert "| `ttft_push_over_pull_loaded` | 0.357 | 0.250-0.500 (2) |" in md
    assert (tmp_path / "ttft_vs_load.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "tpot_vs_load.png").stat().st_size > 0


def test_breakdown_has_a_row_per_repetition_and_the_instances_own_ttft() -> None:
    stage = "router:disagg_router_ttft_stage_seconds{prefill_done_to_first_token}"
    rows = [
        {**_row("ours", 512, 0.9, 150.0, 10.0, rep=1), "ttft_breakdown_ms": {stage: 18.5}},
        {
            **_row("ours", 512, 0.9, 143.0, 10.0),
            "ttft_breakdown_ms": {stage: 43.7, "decode:vllm:time_to_first_token_seconds": 123.6},
        },
        _row("pull", 512, 0.9, 120.0, 11.0),  # not a stack the table shows
        _row("ours", 2048, 0.6, 400.0, 20.0),  # not a fraction it shows
    ]
    lines = breakdown_table(rows, ("ours", "aggregated"), (0.3, 0.9)).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(cells) == 2
    assert [row[head.index("rep")] for row in cells] == ["0", "1"]
    assert [row[head.index("router: P done->D token")] for row in cells] == ["43.7", "18.5"]
    assert [row[head.index("D TTFT (vLLM)")] for row in cells] == ["123.6", "-"]


def test_markdown_marks_failures_and_gaps() -> None:
    table = markdown_table(ROWS, ["ours", "pull", "aggregated"])
    assert (
        "| 2048 | 1.2 | 0 | 2.4 | 900 / 1800 | 5/5 | 30.0 | 2.4 | 5000 / 10000 | 5/7 | 50.0 |"
        " - | - | - | - |" in table
    )


def _m(e2el_p50: float, rate: float = 1.0) -> dict[str, float]:
    """One target's overhead result: E2EL p50 and its double as p99 (TTFT alike), at ``rate``."""
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms")
    values = (e2el_p50, 2 * e2el_p50, e2el_p50, 2 * e2el_p50)
    return {
        "completed": 10,
        "failed": 0,
        "request_throughput": rate,
        **dict(zip(keys, values, strict=True)),
    }


def test_summary_takes_router_overhead_at_the_highest_rate(tmp_path: Path) -> None:
    raw = {
        "fixed_rate": [
            {"rate": 100.0, "targets": {"direct": _m(1.0), "ours": _m(2.0)}},
            {
                "rate": 500.0,
                "targets": {"direct": _m(1.0), "ours": _m(4.0), "vllm-router": _m(1.5)},
            },
        ],
        "saturation": {
            "direct": {**_m(0, 400.0), "fakes_cpu_ms_per_request": 2.0},
            "ours": {**_m(0, 240.0), "fakes_cpu_ms_per_request": 5.0},
        },
    }
    (tmp_path / "overhead.json").write_text(json.dumps({"derived": derive(raw)}))
    summary = render(tmp_path, "disagg-bench overhead")
    assert summary["router_added_ms_p50"] == pytest.approx(3.0)
    assert summary["router_added_ms_p99"] == pytest.approx(6.0)
    assert summary["vllm_router_added_ms_p99"] == pytest.approx(1.0)
    assert summary["router_throughput_over_direct"] == pytest.approx(0.6)
    assert summary["vllm_router_throughput_over_direct"] is None
    assert summary["router_throughput_ceiling_over_direct"] == pytest.approx(0.5)  # 200 of 400
    assert summary["router_throughput_machine_limit_over_direct"] is None  # no client CPU in raw
    assert "at 500 req/s" in (tmp_path / "results.md").read_text()


def test_summary_puts_the_floor_proxy_beside_the_routers(tmp_path: Path) -> None:
    raw = {
        "fixed_rate": [
            {"rate": 100.0, "targets": {"direct": _m(1.0), "floor": _m(3.0)}},
            {"rate": 500.0, "targets": {"direct": _m(1.0), "ours": _m(4.0), "floor": _m(1.25)}},
        ],
        "saturation": {
            "direct": {**_m(0, 400.0), "fakes_cpu_ms_per_request": 2.0},
            "ours": {**_m(0, 240.0), "fakes_cpu_ms_per_request": 5.0},
            "floor": {**_m(0, 300.0), "fakes_cpu_ms_per_request": 5.0},
        },
    }
    (tmp_path / "overhead.json").write_text(json.dumps({"derived": derive(raw)}))
    summary = render(tmp_path, "disagg-bench overhead")
    assert summary["floor_added_ms_p50"] == pytest.approx(0.25)  # at 500 req/s, not 100
    assert summary["floor_added_ms_p99"] == pytest.approx(0.5)
    assert summary["floor_throughput_over_direct"] == pytest.approx(0.75)
    assert summary["router_throughput_over_direct"] == pytest.approx(0.6)
    assert summary["router_cpu_over_vllm_router"] is None  # no vllm-router in this run


def test_summary_puts_each_routers_cpu_per_request_over_vllm_routers(tmp_path: Path) -> None:
    cpu = {"ours": 1.5, "floor": 0.75, "vllm-router": 0.5, "direct": 0.8}
    raw = {
        "fixed_rate": [],
        "saturation": {
            name: {**_m(0, 300.0), "cpu_ms_per_request": ms} for name, ms in cpu.items()
        },
    }
    (tmp_path / "overhead.json").write_text(json.dumps({"derived": derive(raw)}))
    summary = render(tmp_path, "disagg-bench overhead")
    assert summary["router_cpu_over_vllm_router"] == pytest.approx(3.0)
    assert summary["floor_cpu_over_vllm_router"] == pytest.approx(1.5)
    results = (tmp_path / "results.md").read_text()
    assert "| `router_cpu_over_vllm_router` | 3.000 |" in results


def test_cpu_ratio_spread_is_each_saturation_rounds_own_ratio(tmp_path: Path) -> None:
    def run(ms: float) -> dict[str, Any]:
        return {**_m(0, 300.0), "cpu_ms_per_request": ms}

    rounds = {
        "direct": [run(0.8)] * 2,
        "ours": [run(1.2), run(1.5)],
        "vllm-router": [run(1.0), run(0.6)],
    }
    raw = {
        "fixed_rate": [],
        "saturation": {
            k: run(sum(r["cpu_ms_per_request"] for r in v) / 2) for k, v in rounds.items()
        },
        "saturation_rounds": rounds,
    }
    (tmp_path / "overhead.json").write_text(json.dumps({"raw": raw, "derived": derive(raw)}))
    summary = render(tmp_path, "disagg-bench overhead")
    assert summary["router_cpu_over_vllm_router"] == pytest.approx(1.35 / 0.8)
    band = summary["spread"]["router_cpu_over_vllm_router"]
    assert (band["low"], band["high"], band["repetitions"]) == (pytest.approx(1.2), 2.5, 2)
    assert "floor_cpu_over_vllm_router" not in summary["spread"]  # no floor in this run


def test_log_folder_is_the_given_one_kept_or_a_temporary_one_removed_after_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    given = tmp_path / "a" / "logs"
    with log_folder(given, "bench-x-") as folder:
        assert folder == given
        (folder / "child.log").write_text("x")
    assert (given / "child.log").is_file()
    with log_folder(None, "bench-x-") as made:
        assert made.is_dir()
        assert made.name.startswith("bench-x-")
        (made / "child.log").write_text("x")
    assert not made.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"child process logs: {given}",
        f"child process logs: {made}",
    ]


def test_log_folder_of_a_run_that_raised_is_kept_and_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(RuntimeError, match="stack failed"), log_folder(None, "bench-x-") as made:
        (made / "child.log").write_text("x")
        raise RuntimeError("stack failed")
    try:
        assert (made / "child.log").read_text() == "x"
        assert capsys.readouterr().err.splitlines() == [
            f"child process logs: {made}",
            f"child process logs kept: {made}",
        ]
    finally:
        (made / "child.log").unlink()
        made.rmdir()


def test_a_run_whose_process_failed_to_start_gives_none_and_keeps_its_logs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    folders: list[Path] = []

    def run(folder: Path) -> dict[str, Any]:
        folders.append(folder)
        (folder / "child.log").write_text("x")
        raise ProcessStartError("router exited: port in use")

    assert run_in_work_dir(run, None, "bench-x-") is None
    [made] = folders
    try:
        assert (made / "child.log").read_text() == "x"
        assert capsys.readouterr().err.splitlines() == [
            f"child process logs: {made}",
            f"child process logs kept: {made}",
            "error: router exited: port in use",
        ]
    finally:
        (made / "child.log").unlink()
        made.rmdir()
    done = run_in_work_dir(lambda folder: {"ran in": folder}, None, "bench-y-")
    assert done is not None
    assert done["ran in"].name.startswith("bench-y-")
    assert not done["ran in"].exists()  # a run that returned leaves nothing


def test_recorded_command_leaves_out_the_work_dir() -> None:
    argv = ["scenarios", "--work-dir", "/tmp/x", "--stacks", "ours", "--work-dir=/tmp/y"]
    assert recorded_command(argv) == "disagg-bench scenarios --stacks ours"


def test_each_transfer_file_gives_its_key_and_its_section(tmp_path: Path) -> None:
    rounds = [
        {
            "round": 0,
            "kind": "bare-notify",
            "median_latency_ms": 0.5,
            "median_throughput_gbps": 8.0,
        },
        {
            "round": 0,
            "kind": "connector-path",
            "median_latency_ms": 1.0,
            "median_throughput_gbps": 4.0,
        },
    ]
    many = {
        "connector_over_bare_throughput": 0.5,
        "bytes_per_write": 4 * 2**20,
        "descriptors_per_write": 16384,
        "rounds": rounds,
    }
    (tmp_path / "transfer-16k-descriptors.json").write_text(json.dumps(many))
    summary = render(tmp_path, "disagg-bench transfer")
    assert summary["connector_over_bare_nixl_throughput_16k_descriptors"] == pytest.approx(0.5)
    assert summary["connector_over_bare_nixl_throughput"] is None
    results = (tmp_path / "results.md").read_text()
    assert "4 MiB per WRITE in 16384 descriptors (transfer-16k-descriptors.json)" in results
    assert "## Transfer (`transfer-16k-descriptors.json`)" in results
    assert "## Transfer (`transfer.json`)" not in results
    assert "| 0 | connector-path | 1.000 | 4.000 |" in results


def test_a_p_tp_transfer_file_gives_its_tp_named_key(tmp_path: Path) -> None:
    rounds = [
        {"round": 0, "kind": "bare", "median_write_ms": 10.0, "median_throughput_gbps": 6.7},
        {"round": 0, "kind": "connector", "median_write_ms": 11.0, "median_throughput_gbps": 6.1},
    ]
    tp2 = {
        "spec": {"p_tp": 2},
        # The file's own key names the TP; the TP 1 name is absent.
        "connector_over_bare_throughput_p_tp2": 0.91,
        "bytes_per_write": 64 * 2**20,
        "descriptors_per_write": 1024,
        "rounds": rounds,
    }
    (tmp_path / "transfer-64mib-p-tp2.json").write_text(json.dumps(tp2))
    summary = render(tmp_path, "disagg-bench transfer")
    assert summary["connector_over_bare_nixl_throughput_p_tp2"] == pytest.approx(0.91)
    assert summary["connector_over_bare_nixl_throughput_64mib"] is None
    results = (tmp_path / "results.md").read_text()
    assert "P TP 2 -> D TP 1" in results
    assert "64 MiB per WRITE in 1024 descriptors per rank (transfer-64mib-p-tp2.json)" in results
    assert "2 P ranks each WRITE 1024 descriptors (their share of every block)" in results
    assert "| 0 | connector | 11.000 | 6.100 |" in results
