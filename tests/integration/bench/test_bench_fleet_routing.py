"""``disagg-bench fleet-routing``'s runs that meet real processes, at a small scale: router
replicas (processes) and vllm-router over real emulated 2P2D fleets. In the agreement run every
replica's JSON request log names a P for every request, so each one is compared; vllm-router's
kv_aware serves every request of a pull-mode fleet from its KV events."""

from __future__ import annotations

from pathlib import Path

from bench.fleet_routing import FleetRoutingSpec, run_once
from bench.routing_kv import kv_requests

SPEC = FleetRoutingSpec(
    size=2,
    replicas=2,
    rate=40.0,
    chats=3,
    turns=2,
    chat_system_len=256,
    turn_len=32,
    groups=3,
    group_size=2,
    group_prefix_len=256,
    question_len=16,
    output_len=2,
)


def test_every_request_is_routed_by_every_replica_and_compared(tmp_path: Path) -> None:
    requests = kv_requests(SPEC.workload())
    run = run_once("agreement", SPEC, requests, tmp_path)
    assert run["sent"] == 2 * len(requests) and run["failed"] == 0, run
    assert run["compared"] == len(requests)
    assert 0.0 <= run["agreement"] <= 1.0


def test_vllm_router_serves_the_workload_from_the_emulated_fleets_events(tmp_path: Path) -> None:
    requests = kv_requests(SPEC.workload())
    run = run_once("vllm_router", SPEC, requests, tmp_path)
    assert run["sent"] == len(requests) and run["failed"] == 0, run
    # repeated system prompts: P's cache served some of the prompts
    assert run["p_hit_rate"] > 0 and run["mean_ttft_ms"] > 0


def test_one_records_where_the_routers_ttft_goes_stage_by_stage(tmp_path: Path) -> None:
    requests = kv_requests(SPEC.workload())
    run = run_once("one", SPEC, requests, tmp_path)
    assert run["sent"] == len(requests) and run["failed"] == 0, run
    stages = run["router_ttft_stages_ms"]
    # a push-mode stream: both legs sent, P's leg, P done to D's first token, the relay
    assert set(stages) == {
        "accept_to_legs_sent",
        "prefill",
        "prefill_done_to_first_token",
        "relay_to_client",
    }
    assert all(ms > 0 for ms in stages.values()), stages
