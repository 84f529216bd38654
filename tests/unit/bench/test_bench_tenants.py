"""``disagg-bench tenants``'s arithmetic: per-point figures, the summary keys and the report (the
runs themselves need real vLLM)."""

from __future__ import annotations

import pytest

from bench.tenants import Point, TenantsSpec, _tenancy, summarize
from bench.tenants_cmd import format_report


def point(name: str, rep: int, fore: str, ttft: list[float], back: str | None = None) -> Point:
    rates = {fore: 5.0, **({back: 30.0} if back else {})}
    return Point(
        name=name,
        rep=rep,
        rates=rates,
        ttft_ms={fore: ttft, **({back: [100.0] * 6} if back else {})},
        ok={fore: len(ttft), **({back: 6} if back else {})},
        refused={fore: 0, **({back: 24} if back else {})},
        duration_s=1.0,
    )


def run(spec: TenantsSpec) -> dict[str, object]:
    points = []
    for rep in range(2):
        points += [
            point("alone", rep, "victim", [10.0] * 99 + [40.0]),
            point("neighbour", rep, "victim", [10.0] * 99 + [50.0], "noisy"),
            point("noisy", rep, "victim", [10.0] * 99 + [50.0 + 10 * rep], "noisy"),
            point("light", rep, "high", [10.0] * 100),
            point("saturated", rep, "high", [12.0] * 100, "bulk"),
        ]
    tenancy = _tenancy(spec, capacity=20.0)
    metered = {"sent": [(30.0, 1000), (70.0, 5000), (100.0, 4000)], "refusals": 3, "run_s": 120.0}
    return summarize(spec, 20.0, tenancy, points, metered)


def test_the_summary_keys_are_ratios_of_this_runs_points() -> None:
    spec = TenantsSpec()
    data = run(spec)
    keys = data["summary"]
    assert isinstance(keys, dict)
    assert keys["victim_p99_ttft_noisy_over_alone"] == pytest.approx(55.0 / 40.0, abs=1e-3)
    assert keys["victim_p99_ttft_noisy_over_neighbour_at_share"] == pytest.approx(1.1)
    assert keys["priority_p99_ttft_saturated_over_light"] == pytest.approx(1.2)
    rpm = round(spec.share * 20.0 * 60)
    assert keys["noisy_admitted_over_share"] == pytest.approx(6 * 60 / rpm, abs=1e-3)
    limit = round(spec.token_share * 20.0 * 60 * (spec.input_len + spec.output_len))
    # the last minute of a 120 s run: requests sent at 70 s and 100 s
    assert keys["token_limit_error"] == pytest.approx(abs(9000 - limit) / limit, abs=1e-4)


def test_tenancy_gives_each_tenant_a_digest_never_a_key() -> None:
    tenancy = _tenancy(TenantsSpec(), capacity=20.0)
    for tenant in tenancy["tenants"]:
        (digest,) = tenant["key_sha256"]
        assert len(digest) == 64 and "sk-" not in digest


def test_the_report_names_the_command_and_every_point() -> None:
    text = format_report(run(TenantsSpec()))
    assert "disagg-bench tenants" in text
    for row in ("| alone | victim |", "| noisy | noisy |", "| saturated | bulk |"):
        assert row in text
    assert "`token_limit_error`" in text
    assert "tenants --out-dir" in text  # the defaults ran: no option named


def test_the_report_names_the_options_a_run_changed() -> None:
    text = format_report(run(TenantsSpec(requests=30, repetitions=3)))
    assert "tenants --requests 30 --repetitions 3 --out-dir docs/benchmarks`" in text
