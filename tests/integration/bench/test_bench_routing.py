"""``disagg-bench routing``: the uneven-backends part end to end on fakes (a real router
process), the conversation workload's shape, and the artefacts it writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing import (
    RoutingBenchSpec,
    conversation_requests,
    routing_summary,
    run_uneven,
    run_workers,
)
from bench.routing_cmd import render_markdown


def test_uneven_part_runs_both_policies_on_the_same_requests(tmp_path: Path) -> None:
    spec = RoutingBenchSpec(
        parts=("uneven",), uneven_prefill_s=0.02, uneven_rate=20.0, uneven_requests=16
    )
    result = run_uneven(spec, tmp_path)
    runs = result["runs"]
    assert set(runs) == {"round_robin", "power_of_two"}
    assert all(r["completed"] == 16 and r["failed"] == 0 for r in runs.values())
    assert result["p99_ttft_p2c_over_round_robin_uneven"] == (
        runs["power_of_two"]["p99_ttft_ms"] / runs["round_robin"]["p99_ttft_ms"]
    )
    summary = routing_summary({"uneven": result})
    assert summary["p99_ttft_p2c_over_round_robin_uneven"] is not None
    assert summary["ttft_prefix_affinity_over_round_robin"] is None
    table = render_markdown({"uneven": result}, "disagg-bench routing --parts uneven")
    assert "| uneven | power_of_two | 16/16 | " in table


def test_workers_part_runs_one_and_two_workers_on_the_same_requests(tmp_path: Path) -> None:
    spec = RoutingBenchSpec(
        parts=("workers",),
        uneven_prefill_s=0.02,
        uneven_rate=20.0,
        uneven_requests=16,
        workers_rounds=1,
        workers_requests=40,
    )
    result = run_workers(spec, tmp_path)
    runs = result["runs"]
    assert set(runs) == {"workers_1", "workers_2"}
    assert all(r["completed"] == 16 and r["failed"] == 0 for r in runs.values())
    key = "p99_ttft_least_in_flight_workers_over_one"
    assert result[key] == runs["workers_2"]["p99_ttft_ms"] / runs["workers_1"]["p99_ttft_ms"]
    assert routing_summary({"workers": result})[key] == result[key]
    table = render_markdown({"workers": result}, "disagg-bench routing --parts workers")
    assert "| workers | workers_2 | 16/16 | " in table
    assert f"| `{key}` |" in table
    # the closed loop through serve --workers 2 vs one worker, same fakes
    rounds = result["throughput"]["rounds"]
    assert len(rounds) == 1 and set(rounds[0]) == {"workers_1", "workers_2"}
    assert all(r["completed"] == 40 and r["failed"] == 0 for r in rounds[0].values())
    # each worker leads a process group of its own: their CPU counts too
    assert all(r["router_cpu_ms_per_request"] > 0 for r in rounds[0].values())
    ratio = rounds[0]["workers_2"]["rps"] / rounds[0]["workers_1"]["rps"]
    assert result["throughput_workers_over_one"] == pytest.approx(ratio)
    assert "| 1 | workers_2 |" in table


def test_conversations_grow_turn_by_turn_on_their_own_system_prompt() -> None:
    spec = RoutingBenchSpec(conversations=3, turns=3, system_len=40, turn_len=5, output_len=2)
    requests = conversation_requests(spec, seed=1)
    assert len(requests) == 9
    systems = {r.prompt[:40] for r in requests}
    assert len(systems) == 3  # one system prompt per conversation
    for round_index in range(3):
        batch = requests[3 * round_index : 3 * round_index + 3]
        assert {r.prompt[:40] for r in batch} == systems  # each conversation once per round
        assert all(r.prompt_len == 40 + 5 * (round_index + 1) for r in batch)
    first = {r.prompt[:40]: r.prompt for r in requests[:3]}
    assert all(r.prompt[: len(first[r.prompt[:40]])] == first[r.prompt[:40]] for r in requests)
    assert conversation_requests(spec, seed=2)[0].prompt != requests[0].prompt
