"""Report: headline points and ratios from hand-made rows, markdown and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.overhead import derive
from bench.report import headline_point, markdown_table, render


def _row(
    stack: str, input_len: int, rate: float, ttft: float, tpot: float, failed: int = 0
) -> dict[str, Any]:
    metrics = {
        "completed": 5,
        "failed": failed,
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "mean_tpot_ms": tpot,
    }
    return {"stack": stack, "input_len": input_len, "rate": rate, "metrics": metrics}


ROWS = [
    _row("ours", 512, 1.0, 100.0, 10.0),
    _row("pull", 512, 1.0, 120.0, 11.0),
    _row("ours", 2048, 1.0, 200.0, 10.0),
    _row("pull", 2048, 1.0, 300.0, 12.0),
    _row("ours", 2048, 4.0, 400.0, 20.0),
    _row("pull", 2048, 4.0, 1600.0, 40.0),
    _row("ours", 2048, 8.0, 900.0, 30.0),
    _row("pull", 2048, 8.0, 5000.0, 50.0, failed=2),  # not clean: not a headline point
    _row("aggregated", 2048, 1.0, 160.0, 9.0),
    _row("ours-spin", 2048, 4.0, 800.0, 25.0),
]


def test_headline_points() -> None:
    assert headline_point(ROWS, "ours", "pull", loaded=True) == (2048, 4.0)
    assert headline_point(ROWS, "ours", "pull", loaded=False) == (2048, 1.0)
    assert headline_point(ROWS, "ours", "vllm-push", loaded=True) is None


def test_render_writes_summary_table_and_plots(tmp_path: Path) -> None:
    (tmp_path / "scenarios.json").write_text(
        json.dumps({"rows": ROWS, "stacks": ["ours", "pull", "aggregated"], "errors": {}})
    )
    (tmp_path / "transfer.json").write_text(json.dumps({"connector_over_bare_throughput": 0.9}))
    summary = render(tmp_path, "disagg-bench scenarios")
    assert summary["ttft_push_over_pull_loaded"] == pytest.approx(0.25)
    assert summary["tpot_push_over_pull_loaded"] == pytest.approx(0.5)
    assert summary["ttft_push_over_aggregated_light"] == pytest.approx(200 / 160)
    assert summary["ttft_ours_over_vllm_push_loaded"] is None
    assert summary["ttft_push_spin_over_pull_loaded"] == pytest.approx(0.5)
    assert summary["ttft_push_spin_over_push_loaded"] == pytest.approx(2.0)
    assert summary["router_added_ms_p50"] is None
    assert summary["connector_over_bare_nixl_throughput"] == pytest.approx(0.9)
    assert summary["machine"]["cores"] >= 1
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert set(on_disk) >= {"measured_at", "machine", "vllm_router_added_ms_p50"}
    md = (tmp_path / "results.md").read_text()
    assert "no sweep point where both ours and vllm-push" in md
    assert (tmp_path / "ttft_vs_rate.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "tpot_vs_rate.png").stat().st_size > 0


def test_markdown_marks_failures_and_gaps() -> None:
    table = markdown_table(ROWS, ["ours", "pull", "aggregated"])
    assert "| 2048 | 8 | 900 / 1800 | 30.0 | 5000 / 10000 (2 failed) | 50.0 | - | - |" in table


def test_summary_takes_router_overhead_at_the_highest_rate(tmp_path: Path) -> None:
    def m(e2el_p50: float, rate: float = 1.0) -> dict[str, float]:
        keys = ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms")
        values = (e2el_p50, 2 * e2el_p50, e2el_p50, 2 * e2el_p50)
        return {
            "completed": 10,
            "failed": 0,
            "request_throughput": rate,
            **dict(zip(keys, values, strict=True)),
        }

    raw = {
        "fixed_rate": [
            {"rate": 100.0, "targets": {"direct": m(1.0), "ours": m(2.0)}},
            {"rate": 500.0, "targets": {"direct": m(1.0), "ours": m(4.0), "vllm-router": m(1.5)}},
        ],
        "saturation": {"direct": m(0, 400.0), "ours": m(0, 240.0)},
    }
    (tmp_path / "overhead.json").write_text(json.dumps({"derived": derive(raw)}))
    summary = render(tmp_path, "disagg-bench overhead")
    assert summary["router_added_ms_p50"] == pytest.approx(3.0)
    assert summary["router_added_ms_p99"] == pytest.approx(6.0)
    assert summary["vllm_router_added_ms_p99"] == pytest.approx(1.0)
    assert summary["router_throughput_over_direct"] == pytest.approx(0.6)
    assert summary["vllm_router_throughput_over_direct"] is None
    assert "at 500 req/s" in (tmp_path / "results.md").read_text()
