"""``disagg-bench fleet-routing``'s pure parts: what each run sends where, the P each replica
chose read from its JSON request log, the agreement between replicas, vllm-router's arguments,
the summary keys, the report."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from bench.client import Target
from bench.dataset import BenchRequest
from bench.fleet_routing import (
    RUNS,
    FleetRoutingSpec,
    agreement,
    chosen_prefills,
    send_plan,
    summary_keys,
    vllm_router_args,
)
from bench.fleet_routing_cmd import format_report, output_stem

TARGETS = [Target(f"http://127.0.0.1:{port}", "m") for port in (8001, 8002, 8003)]
REQUESTS = [BenchRequest((1, 2, i), 3, 4) for i in range(5)]


def _summary(client_id: str | None, prefill: str | None) -> str:
    return json.dumps(
        {"message": "request ...", "client_request_id": client_id, "prefill": prefill}
    )


def test_one_sends_everything_to_the_first_replica_and_spread_takes_turns() -> None:
    one = send_plan("one", REQUESTS, TARGETS)
    assert [[t.base_url for t, _ in sends] for sends in one] == [[TARGETS[0].base_url]] * 5
    spread = send_plan("spread", REQUESTS, TARGETS)
    assert [sends[0][0].base_url for sends in spread] == [TARGETS[i % 3].base_url for i in range(5)]
    assert [sends[0][1] for sends in spread] == REQUESTS


def test_agreement_sends_each_request_to_every_replica_under_one_request_id() -> None:
    plan = send_plan("agreement", REQUESTS, TARGETS)
    assert len(plan) == len(REQUESTS)
    for i, sends in enumerate(plan):
        assert [t.base_url for t, _ in sends] == [t.base_url for t in TARGETS]
        assert {t.headers for t, _ in sends} == {(("X-Request-Id", f"rq-{i}"),)}
        assert {r for _, r in sends} == {REQUESTS[i]}


def test_the_chosen_p_is_read_from_the_json_summaries_only() -> None:
    lines = [
        "INFO:     127.0.0.1:5000 - POST /v1/completions 200",  # not JSON
        "{not json",
        _summary("rq-0", "p3"),
        _summary(None, "p1"),  # no client id: not comparable
        _summary("rq-1", None),  # D alone: no P
        _summary("rq-2", "p0"),
    ]
    assert chosen_prefills(lines) == {"rq-0": "p3", "rq-2": "p0"}


def test_agreement_counts_the_requests_every_replica_routed_to_one_p() -> None:
    a = {"rq-0": "p0", "rq-1": "p1", "rq-2": "p2", "rq-3": "p3"}
    b = {"rq-0": "p0", "rq-1": "p1", "rq-2": "p9", "rq-3": "p3"}
    c = {"rq-0": "p0", "rq-1": "p1", "rq-2": "p2"}  # rq-3 not logged here: not compared
    assert agreement([a, b, c]) == (pytest.approx(2 / 3), 3)
    assert agreement([a, a]) == (1.0, 4)
    assert agreement([a, {}]) == (0.0, 0)
    assert agreement([]) == (0.0, 0)


def test_vllm_router_is_kv_aware_over_every_ps_events() -> None:
    instances = {
        "prefill": [
            {"url": "http://127.0.0.1:1", "kv_events_endpoint": "tcp://127.0.0.1:11"},
            {"url": "http://127.0.0.1:2", "kv_events_endpoint": "tcp://127.0.0.1:12"},
        ],
        "decode": [{"url": "http://127.0.0.1:3"}],
    }
    args = vllm_router_args(instances, 16)
    assert args[:4] == ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin"]
    events = [args[i + 1] for i, a in enumerate(args) if a == "--pd-kv-events"]
    assert events == [
        "http://127.0.0.1:1=tcp://127.0.0.1:11",
        "http://127.0.0.1:2=tcp://127.0.0.1:12",
    ]
    assert args[-2:] == ["--kv-event-block-size", "16"]


def _runs(**hit_ttft: tuple[float, float]) -> dict[str, dict[str, Any]]:
    runs = {
        name: {"routers": 3, "sent": 10, "failed": 0, "p_hit_rate": h, "mean_ttft_ms": t}
        for name, (h, t) in hit_ttft.items()
    }
    runs["agreement"].update(agreement=0.9, compared=10)
    return runs


def test_the_summary_compares_one_router_with_replicas_and_with_vllm_router() -> None:
    spec = FleetRoutingSpec(size=16, replicas=3)
    runs = _runs(
        one=(0.6, 50.0), spread=(0.3, 60.0), agreement=(0.0, 0.0), vllm_router=(0.4, 100.0)
    )
    assert summary_keys(spec, runs) == {
        "replica_choice_agreement": 0.9,
        "p_hit_rate_3_replicas_over_1": 0.5,
        "p_hit_rate_16p16d_over_vllm_router_kv_aware": 1.5,
        "ttft_16p16d_over_vllm_router_kv_aware": 0.5,
    }
    del runs["vllm_router"]
    assert set(summary_keys(spec, runs)) == {
        "replica_choice_agreement",
        "p_hit_rate_3_replicas_over_1",
    }


def test_the_report_names_its_command_runs_and_keys() -> None:
    spec = FleetRoutingSpec(size=4, vllm_router=False)
    runs = _runs(one=(0.5, 20.0), spread=(0.5, 20.0), agreement=(0.0, 0.0))
    data = {
        "spec": asdict(spec),
        "requests": 10,
        "best_hit_rate": 0.7,
        "runs": runs,
        "summary": summary_keys(spec, runs),
    }
    report = format_report(data)
    command = ".venv/bin/disagg-bench fleet-routing --size 4 --no-vllm-router --out-dir"
    assert f"`{command} docs/benchmarks`" in report
    assert "| agreement | 3 | 10 | 0 | - | - | 0.900 of 10 |" in report
    assert "| spread | 3 | 10 | 0 | 0.500 | 20.0 | - |" in report
    assert "- `replica_choice_agreement`: 0.9" in report
    assert set(RUNS) >= set(runs)


def test_a_run_with_another_profile_names_it_in_its_command_and_files() -> None:
    spec = FleetRoutingSpec(profile="h200-qwen3-32b-tp1")
    runs = _runs(one=(0.5, 20.0), spread=(0.5, 20.0), agreement=(0.0, 0.0))
    data = {"spec": asdict(spec), "requests": 10, "best_hit_rate": 0.7, "runs": runs}
    report = format_report({**data, "summary": {}})
    assert "fleet-routing --profile h200-qwen3-32b-tp1 --out-dir docs/benchmarks`" in report
    assert output_stem(spec.profile) == "fleet-routing-h200-qwen3-32b-tp1"
    assert output_stem("profiles/h200.json") == "fleet-routing-h200"
    assert output_stem(FleetRoutingSpec().profile) == "fleet-routing"


def test_the_report_says_where_ones_ttft_goes_inside_the_router_when_recorded() -> None:
    spec = FleetRoutingSpec(size=4, vllm_router=False)
    runs = _runs(one=(0.5, 20.0), spread=(0.5, 20.0), agreement=(0.0, 0.0))
    data = {"spec": asdict(spec), "requests": 10, "best_hit_rate": 0.7, "runs": runs}
    data["summary"] = summary_keys(spec, runs)
    assert "TTFT goes inside the router" not in format_report(data)
    runs["one"]["router_ttft_stages_ms"] = {
        "accept_to_legs_sent": 0.5,
        "prefill": 8.0,
        "relay_to_client": 0.25,
    }
    assert (
        "over the run): accept_to_legs_sent 0.50 ms, prefill 8.00 ms, relay_to_client 0.25 ms; "
        "they add up to 8.75 ms." in format_report(data)
    )
