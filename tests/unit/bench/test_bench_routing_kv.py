"""The ``kv`` part of ``disagg-bench routing``: its workload, best hit rate, summary and table
(the runs themselves need real vLLM)."""

from __future__ import annotations

from typing import Any

from bench.dataset import BenchRequest
from bench.routing import RoutingBenchSpec, kv_plan, routing_summary
from bench.routing_cmd import render_markdown
from bench.routing_kv import (
    KvWorkload,
    best_hit_rate,
    hit_rate,
    kv_requests,
    summarize,
    vllm_router_args,
)

WORKLOAD = KvWorkload(
    chats=3,
    turns=3,
    chat_system_len=256,
    turn_len=32,
    groups=2,
    group_size=4,
    group_prefix_len=512,
    question_len=16,
    output_len=4,
    seed=1,
)


def test_the_workload_is_deterministic_and_grows_chats_turn_by_turn() -> None:
    requests = kv_requests(WORKLOAD)
    assert requests == kv_requests(WORKLOAD)
    assert len(requests) == 3 * 3 + 2 * 4
    chat_lengths = sorted({r.prompt_len for r in requests if r.prompt_len < 512})
    assert chat_lengths == [256 + 32 * t for t in (1, 2, 3)]


def test_best_hit_rate_counts_block_aligned_shared_prefixes() -> None:
    a = tuple(range(300))
    requests = [BenchRequest(a, 300, 1), BenchRequest(a[:256] + (9,) * 44, 300, 1)]
    assert best_hit_rate(requests, 128) == 256 / 600
    assert best_hit_rate(requests[:1], 128) == 0.0


def _run(ttft: float, hit: float, cpu: float) -> dict[str, Any]:
    return {
        "completed": 10,
        "failed": 0,
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "p_hit_rate": hit,
        "router_cpu_ms_per_request": cpu,
    }


def test_summary_ratios_use_the_mean_over_repetitions_and_keep_errors() -> None:
    runs = {
        "round_robin": [_run(100, 0.1, 1.0), _run(300, 0.1, 1.0)],
        "kv_aware": [_run(80, 0.6, 1.5), _run(120, 0.8, 1.5)],
        "vllm_router_kv_aware": [{"error": "RuntimeError: no kv events"}],
    }
    kv = summarize(runs, best=0.9)
    assert kv["ttft_kv_aware_over_round_robin"] == 0.5
    assert kv["stacks"]["kv_aware"]["mean_ttft_ms_spread"] == [80, 120]
    assert kv["ttft_kv_aware_over_vllm_router_kv_aware"] is None
    assert kv["router_cpu_kv_aware_over_round_robin"] == 1.5
    summary = routing_summary({"kv": kv})
    assert summary["ttft_kv_aware_over_round_robin"] == 0.5
    table = render_markdown({"kv": kv}, "disagg-bench routing --parts kv")
    assert "no kv events" in table and "0.90" in table


def test_the_plan_takes_the_cli_knobs() -> None:
    plan = kv_plan(RoutingBenchSpec(kv_stacks="kv_aware,round_robin", kv_repetitions=3))
    assert plan.stacks == ("kv_aware", "round_robin") and plan.repetitions == 3


class _Instance:
    def __init__(self, name: str) -> None:
        self.url = f"http://127.0.0.1:81{name[-1]}0"
        self.kv_endpoints = {"kv_events_endpoint": f"tcp://127.0.0.1:55{name[-1]}7"}


class _Stack:
    prefill = [_Instance("p0"), _Instance("p1")]


def test_vllm_router_kv_aware_gets_every_prefills_event_source() -> None:
    args = vllm_router_args(_Stack(), "vllm_router_kv_aware", 128)
    assert args[:2] == ["--prefill-policy", "kv_aware"]
    assert "http://127.0.0.1:8100=tcp://127.0.0.1:5507" in args
    assert args[-2:] == ["--kv-event-block-size", "128"]
    assert vllm_router_args(_Stack(), "vllm_router_cache_aware", 128)[1] == "cache_aware"


def test_the_hit_rate_is_of_the_tokens_queried_between_two_readings() -> None:
    assert hit_rate((10.0, 100.0), (40.0, 160.0)) == 0.5  # 30 of 60 new tokens hit
    assert hit_rate((10.0, 100.0), (10.0, 100.0)) == 0.0  # nothing queried
