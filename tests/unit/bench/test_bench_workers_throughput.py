"""``bench.workers_throughput``: the report arithmetic of the workers part's closed loop."""

from __future__ import annotations

from typing import Any

import pytest

from bench.routing_cmd import render_markdown
from bench.workers_throughput import ThroughputSpec, throughput_summary


def _round(one: float, two: float, failed: int = 0) -> dict[str, dict[str, Any]]:
    return {
        "workers_1": {"rps": one, "router_cpu_ms_per_request": 1.0, "failed": 0},
        "workers_2": {"rps": two, "router_cpu_ms_per_request": 2.0, "failed": failed},
    }


def test_ratio_is_mean_rate_at_n_workers_over_mean_rate_at_one() -> None:
    summary = throughput_summary([_round(100.0, 150.0), _round(200.0, 210.0)], workers=2)
    assert summary["workers_1_rps"] == 150.0
    assert summary["workers_2_rps"] == 180.0
    assert summary["throughput_workers_over_one"] == pytest.approx(1.2)
    assert summary["per_round_workers_over_one"] == [1.5, pytest.approx(1.05)]
    assert summary["workers_2_router_cpu_ms_per_request"] == 2.0


def test_a_round_with_failures_gives_no_ratio() -> None:
    summary = throughput_summary([_round(100.0, 150.0), _round(100.0, 150.0, failed=3)], 2)
    assert summary["throughput_workers_over_one"] is None
    assert summary["workers_2_rps"] == 150.0  # the rates are still reported


def test_no_rounds_give_no_ratio() -> None:
    summary = throughput_summary([], workers=2)
    assert summary["throughput_workers_over_one"] is None
    assert summary["workers_1_rps"] is None


def test_markdown_lists_every_round_and_the_ratio() -> None:
    throughput = throughput_summary([_round(100.0, 150.0)], workers=2)
    throughput["spec"] = ThroughputSpec(rounds=1).__dict__
    result = {
        "workers": {
            "runs": {},
            "throughput": throughput,
            **{"throughput_workers_over_one": throughput["throughput_workers_over_one"]},
        }
    }
    table = render_markdown(result, "disagg-bench routing --parts workers")
    assert "| 1 | workers_2 | 150.0 | 2.00 | 0 |" in table
    assert "| `throughput_workers_over_one` | 1.500 | - |" in table
    assert "Per round, 2 workers / 1: 1.50." in table
