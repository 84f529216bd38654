"""Overhead bookkeeping: config accepted by the router's schema, ratios from the same run, the
marginal CPU per relayed token from two output lengths."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench import overhead
from bench.client import Target
from bench.loadgen import LoadSpec
from bench.overhead import FAKE_PREFILL_IDENTITY as IDENTITY
from bench.overhead import (
    OverheadSpec,
    _stages_during,
    derive,
    fake_process,
    format_report,
    pooled,
)
from bench.routers import our_router, router_config
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.observability.metrics import RouterMetrics


def test_router_config_is_valid_for_the_router() -> None:
    config = router_config("m", "http://127.0.0.1:1", "http://127.0.0.1:2", identity=IDENTITY)
    settings = settings_from_mapping(config)
    assert settings.mode == "push"
    assert settings.prefill.instances[0].identity is not None


def test_token_delay_reaches_the_fakes_command_line(tmp_path: Path) -> None:
    """``--token-delay`` is the fake's own flag (``devstack.fake_vllm``); 0 leaves it out."""
    paced = fake_process("fake", 1, tmp_path, token_delay=0.02).process.argv
    assert paced[paced.index("--token-delay") + 1] == "0.02"
    assert "--token-delay" not in fake_process("fake", 1, tmp_path).process.argv


def _m(
    rate: float, ttft50: float, ttft99: float, e2el50: float, e2el99: float, fakes_ms: float = 0.0
) -> dict[str, float]:
    return {
        "fakes_cpu_ms_per_request": fakes_ms,
        "completed": 10,
        "failed": 0,
        "request_throughput": rate,
        "median_ttft_ms": ttft50,
        "p99_ttft_ms": ttft99,
        "median_e2el_ms": e2el50,
        "p99_e2el_ms": e2el99,
        "median_itl_ms": 0.1,
    }


def test_derive_subtracts_and_divides_by_direct() -> None:
    raw = {
        "fixed_rate": [
            {
                "rate": 10.0,
                "targets": {
                    "direct": _m(10, 1.0, 2.0, 4.0, 8.0),
                    "ours": _m(10, 3.0, 7.0, 6.0, 12.0),
                },
            }
        ],
        "saturation": {"direct": _m(400, 0, 0, 0, 0), "ours": _m(100, 0, 0, 0, 0)},
    }
    d = derive(raw)
    (row,) = d["added"]["ours"]
    assert row["added_ttft_ms_p50"] == pytest.approx(2.0)
    assert row["added_ttft_ms_p99"] == pytest.approx(5.0)
    assert row["added_e2el_ms_p50"] == pytest.approx(2.0)
    assert row["e2el_p99_ratio"] == pytest.approx(1.5)
    assert d["saturation"]["ours"]["ratio_to_direct"] == pytest.approx(0.25)
    assert "| ours | 10 | 2.00 / 5.00 |" in format_report(d)


def test_the_fakes_core_caps_what_any_router_could_reach() -> None:
    raw = {
        "fixed_rate": [],
        "saturation": {
            "direct": _m(2000, 0, 0, 0, 0, fakes_ms=0.4),
            "ours": _m(800, 0, 0, 0, 0, fakes_ms=1.0),
        },
    }
    sat = derive(raw)["saturation"]
    assert sat["ours"]["fakes_limit_rps"] == pytest.approx(1000.0)
    assert sat["ours"]["fakes_limit_over_direct"] == pytest.approx(0.5)  # 1000 of 2000 req/s
    assert sat["direct"]["fakes_limit_over_direct"] == pytest.approx(1.25)
    assert "| ours | 800.0 | 0.40x | 0 | n/a | 1.00 | 0.50x | n/a | n/a |" in format_report(
        derive(raw)
    )


def test_the_whole_machine_caps_it_with_the_load_generators_cpu() -> None:
    raw = {
        "cpu_count": 2,
        "fixed_rate": [],
        "saturation": {
            "direct": {**_m(1000, 0, 0, 0, 0, fakes_ms=0.5), "client_cpu_ms_per_request": 0.5},
            "ours": {**_m(500, 0, 0, 0, 0, fakes_ms=1.5), "client_cpu_ms_per_request": 1.0},
            "vllm-router": _m(600, 0, 0, 0, 0, fakes_ms=1.5),  # no load generator CPU recorded
        },
    }
    sat = derive(raw)["saturation"]
    # 2 cores / (1.0 + 1.5 ms) = 800 req/s of direct's 1000, whatever the router costs
    assert sat["ours"]["machine_limit_over_direct"] == pytest.approx(0.8)
    assert sat["direct"]["machine_limit_over_direct"] == pytest.approx(2.0)
    assert sat["vllm-router"]["machine_limit_over_direct"] is None
    assert "| 1.00 | 0.80x |" in format_report(derive(raw))
    assert (
        derive({**raw, "cpu_count": None})["saturation"]["ours"]["machine_limit_over_direct"]
        is None
    )


def test_stages_ride_along_to_their_own_table() -> None:
    stages = {"accept_to_legs_sent": 0.5, "prefill": 1.0, "relay_to_client": 0.25}
    ours = {**_m(10, 3.0, 7.0, 6.0, 12.0), "ttft_stages_ms": stages}
    raw = {
        "fixed_rate": [{"rate": 10.0, "targets": {"direct": _m(10, 1, 2, 4, 8), "ours": ours}}],
        "saturation": {"direct": _m(400, 0, 0, 0, 0), "ours": _m(100, 0, 0, 0, 0)},
    }
    d = derive(raw)
    assert d["added"]["ours"][0]["ttft_stages_ms"] == stages
    # accept_to_legs_sent, prefill, prefill_done_to_first_token, decode_to_first_token, relay
    assert "| ours | 10 | 0.50 | 1.00 | n/a | n/a | 0.25 | 1.75 |" in format_report(d)
    del ours["ttft_stages_ms"]
    assert "accept_to_legs_sent" not in format_report(derive(raw))


async def test_stages_are_the_means_over_exactly_the_load() -> None:
    """Two scrapes of a real router metrics registry around the load: only its observations."""
    metrics = RouterMetrics(CollectorRegistry())
    stage = metrics.ttft_stage
    stage.labels("prefill").observe(9.0)  # before the load: not counted

    async def load() -> str:
        stage.labels("prefill").observe(0.001)
        stage.labels("prefill").observe(0.003)
        stage.labels("relay_to_client").observe(0.0005)
        return "done"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=generate_latest(metrics.registry))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        result, stages = await _stages_during(client, "ours", "http://r/metrics", load())
        assert result == "done"
        assert stages == pytest.approx({"prefill": 2.0, "relay_to_client": 0.5})
        assert await _stages_during(client, "ours", None, load()) == ("done", None)


def test_rounds_pool_cpu_over_all_requests_and_keep_the_median_rounds_latencies() -> None:
    """CPU per request weighs each round by its requests (not a mean of means); throughput and
    latencies are the median-throughput round's, counts are summed."""
    runs = [
        {**_m(100, 1.0, 1.0, 1.0, 1.0), "completed": 10, "cpu_ms_per_request": 1.0},
        {**_m(300, 3.0, 3.0, 3.0, 3.0), "completed": 30, "cpu_ms_per_request": 2.0},
        {**_m(200, 2.0, 2.0, 2.0, 2.0), "completed": 20, "cpu_ms_per_request": 4.0},
    ]
    runs[1]["failed"] = 2
    out = pooled(runs)
    assert out["cpu_ms_per_request"] == pytest.approx((10 * 1 + 30 * 2 + 20 * 4) / 60)
    assert (out["completed"], out["failed"]) == (60, 2)
    assert (out["request_throughput"], out["median_ttft_ms"]) == (200, 2.0)
    assert out["fakes_cpu_ms_per_request"] == 0.0


def test_a_baseline_checkout_runs_its_own_router_package(tmp_path: Path) -> None:
    """``--baseline DIR``: the router process imports the router from DIR first (its
    ``disagg_router.router``, or ``router`` in a checkout from before the one top-level
    package); ours keeps the environment it was given."""
    config = router_config("m", "http://127.0.0.1:1", "http://127.0.0.1:2", identity=IDENTITY)
    other = tmp_path / "other-checkout"
    baseline = our_router(config, 1, tmp_path, source=other).process
    assert baseline.env is not None and baseline.env["PYTHONPATH"] == str(other.resolve())
    # -P: the working dir cannot shadow it
    assert baseline.argv[1:4] == ("-P", "-m", "disagg_router.router.cli")
    (other / "router").mkdir(parents=True)
    (other / "router" / "cli.py").write_text("")
    older = our_router(config, 3, tmp_path, source=other).process
    assert older.argv[1:4] == ("-P", "-m", "router.cli")
    assert our_router(config, 2, tmp_path).process.env is None


def _cpu(ms: float) -> dict[str, float]:
    return {**_m(10, 1.0, 2.0, 4.0, 8.0), "cpu_ms_per_request": ms}


def test_the_marginal_cost_is_the_slope_between_two_output_lengths() -> None:
    """16 -> 116 tokens: (long - short) ms over 100 tokens, in us; each over vllm-router's and
    the floor's; a target that saturated at the rate (no longer load) is left out."""
    raw = {
        "output_lens": [16, 116],
        "fixed_rate": [
            {
                "rate": 20.0,
                "targets": {
                    "direct": _cpu(0.5),
                    "ours": _cpu(3.0),
                    "floor": _cpu(1.5),
                    "vllm-router": _cpu(1.0),
                    "slow": _cpu(9.0),
                },
                "marginal": {
                    "direct": _cpu(2.5),
                    "ours": _cpu(7.5),
                    "floor": _cpu(5.5),
                    "vllm-router": _cpu(4.0),
                },
            }
        ],
        "saturation": {"direct": _m(400, 0, 0, 0, 0)},
    }
    d = derive(raw)
    (row,) = d["marginal"]
    assert row["us_per_token"] == pytest.approx(
        {"direct": 20.0, "ours": 45.0, "floor": 40.0, "vllm-router": 30.0}
    )
    assert row["over_vllm_router"]["ours"] == pytest.approx(1.5)
    assert row["over_floor"]["ours"] == pytest.approx(45 / 40)
    assert "vllm-router" not in row["over_vllm_router"] and "floor" not in row["over_floor"]
    report = format_report(d)
    assert "CPU us per relayed token (slope, 16 to 116 tokens)" in report
    assert "| ours | 20 | 45.0 | 1.50x | 1.12x |" in report
    assert "| vllm-router | 20 | 30.0 | n/a | 0.75x |" in report
    del raw["output_lens"]
    assert derive(raw)["marginal"] == []
    assert "per relayed token" not in format_report(derive(raw))


async def test_each_target_takes_the_longer_answers_right_after_its_own_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a marginal output length, every fixed rate runs each target at the output length
    and then at the longer one (same prompts and arrivals), before the next target; a target
    that could not keep up with the rate gets no longer load and no further rates."""
    loads: list[tuple[str, int, int, float]] = []

    async def timed(
        client: object, target: Target, requests: list[Any], load: LoadSpec, *rest: object
    ) -> tuple[Any, dict[str, Any]]:
        lens = {r.output_len for r in requests}
        assert len(lens) == 1
        loads.append((target.base_url, lens.pop(), len(requests), load.request_rate))
        rate = load.request_rate
        kept_up = rate if target.base_url != "http://slow" else rate / 4
        result = SimpleNamespace(metrics=SimpleNamespace(request_throughput=kept_up))
        return result, _cpu(1.0)

    async def warm(*args: object) -> None:
        return None

    monkeypatch.setattr(overhead, "_timed_load", timed)
    monkeypatch.setattr(overhead, "run_load", warm)
    monkeypatch.setattr(overhead, "_saturation_size", lambda *a: _size())
    spec = OverheadSpec(
        rates=(10.0, 20.0), seconds_per_rate=1.0, output_len=4, marginal_output_len=40
    )
    targets = {"fast": Target("http://fast", "m"), "slow": Target("http://slow", "m")}
    raw = await overhead.measure(targets, spec)
    fixed = [entry for entry in loads if math.isfinite(entry[3])]
    assert fixed == [
        ("http://fast", 4, 10, 10.0),
        ("http://fast", 40, 10, 10.0),
        ("http://slow", 4, 10, 10.0),
        ("http://fast", 4, 20, 20.0),
        ("http://fast", 40, 20, 20.0),
    ]
    assert raw["output_lens"] == [4, 40]
    assert set(raw["fixed_rate"][0]["marginal"]) == {"fast"}


async def _size() -> int:
    return 12


def test_a_marginal_output_length_equal_to_the_output_length_is_refused() -> None:
    with pytest.raises(ValueError, match="marginal output length 16: a token count >= 1"):
        OverheadSpec(output_len=16, marginal_output_len=16)
    with pytest.raises(ValueError, match="marginal output length 0"):
        OverheadSpec(marginal_output_len=0)
