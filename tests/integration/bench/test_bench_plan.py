"""``disagg-bench plan`` over real emulated fleets (the fast profile) behind our router: the
smallest fleet, 1P1D, is run in both transfer modes, every measured request completes, and the
choice is the mode with the lower TTFT at the SLO's percentile."""

from __future__ import annotations

from pathlib import Path

from bench.plan import PlanSpec, Slo, Workload, run_plan


def test_the_smallest_fleet_meets_a_loose_slo_in_both_modes(tmp_path: Path) -> None:
    spec = PlanSpec(
        "cpu-tiny",
        Workload(isl=256, osl=8, rate=4.0),
        Slo(ttft_ms=30_000.0, tpot_ms=5_000.0),
        max_instances=3,
        modes=("push", "pull"),
        requests=10,
    )
    data = run_plan(spec, tmp_path)
    rows = data["rows"]
    assert [(r["prefill"], r["decode"], r["mode"]) for r in rows] == [
        (1, 1, "push"),
        (1, 1, "pull"),
    ]
    for row in rows:
        assert row["ran"] and row["met"], row
        assert (row["measured"], row["failed"]) == (8, 0)
        assert 0 < row["ttft_p50_ms"] <= row["ttft_ms"] and row["tpot_ms"] > 0
    assert data["choice"] == min(rows, key=lambda r: r["ttft_ms"])
