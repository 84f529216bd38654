"""The scenario runner's flow (stack start, sweep, per-point JSON, report) on a fake instance."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.report import render
from bench.scenarios import (
    GROUPS,
    InstanceGroup,
    SweepSpec,
    point_name,
    run_scenarios,
    sweep_one,
    sweep_prompts,
    wait_idle,
)
from devstack.ports import free_port
from devstack.process import http_process


@dataclass
class _Instance:
    url: str


class _FakeStack:
    """Stands in for a devstack aggregated stack: one fake vLLM process with fixed delays."""

    model_name = "fake"

    def __init__(self, logs: Path, ttft_s: float = 0.01) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "devstack.fake_vllm", "--port", str(port)]
        argv += ["--prefill-delay", str(ttft_s), "--token-delay", "0.001"]
        self.proc = http_process("fake", argv, f"http://127.0.0.1:{port}/health", logs / "f.log")
        self.proc.start()
        self.aggregated = [_Instance(f"http://127.0.0.1:{port}")]
        self.stopped = False

    def stop(self) -> None:
        self.proc.stop()
        self.stopped = True


def test_runner_sweeps_at_fractions_of_measured_capacity(tmp_path: Path) -> None:
    started: list[_FakeStack] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        assert group.topology == "aggregated"
        started.append(_FakeStack(logs))
        return started[-1]

    spec = SweepSpec(
        input_lens=(16, 32),
        fractions=(0.5, 0.8, 1.0),
        light_fraction=0.5,
        loaded_fraction=1.0,
        repetitions=2,
        output_len=4,
        min_requests=3,
        max_requests=3,
        capacity_requests=6,
        num_warmups=1,
    )
    data = run_scenarios(spec, ("aggregated",), tmp_path, tmp_path / "work", start_stack=start)
    assert data["errors"] == {}
    assert started and started[0].stopped
    caps = {c["input_len"]: c for c in data["capacities"]}
    assert set(caps) == {16, 32} and all(c["completed"] == 6 for c in caps.values())
    # light and loaded points run twice, the others once; each at fraction x that capacity
    points = [(r["input_len"], r["fraction"], r["rep"]) for r in data["rows"]]
    reps = {0.5: 2, 0.8: 1, 1.0: 2}
    assert points == [(n, f, rep) for n in (16, 32) for f in reps for rep in range(reps[f])]
    for row in data["rows"]:
        capacity = caps[row["input_len"]]["request_throughput"]
        assert row["rate"] == pytest.approx(row["fraction"] * capacity)
        assert row["metrics"]["completed"] == 3 and row["metrics"]["goodput"] == 1.0
        # the warm-up, alone on the idle stack just before the point, is timed
        assert set(row["alone"]) == {"ttft_ms", "tpot_ms"}
        assert row["alone"]["ttft_ms"] > 0 and row["alone"]["tpot_ms"] > 0
    run_file = tmp_path / "runs" / "aggregated_in16_f0.5_rep1.json"
    assert json.loads(run_file.read_text())["metrics"]["total_output_tokens"] == 12
    (tmp_path / "scenarios.json").write_text(json.dumps(data))
    from bench.scenarios_cmd import rows_from_runs

    def name(r: dict[str, Any]) -> str:
        return point_name("aggregated", r["input_len"], r["fraction"], r["rep"])

    assert rows_from_runs(tmp_path) == sorted(json.loads(json.dumps(data["rows"])), key=name)
    summary = render(tmp_path, "test")
    assert summary["ttft_push_over_pull_loaded"] is None  # only the aggregated stack ran
    assert set(summary["capacity_rps"]["aggregated"]) == {"16", "32"}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs cores 0 and 1")
def test_pinned_sweep_runs_the_load_generator_on_core_1(tmp_path: Path) -> None:
    seen: list[set[int]] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        seen.append(os.sched_getaffinity(0))
        return _FakeStack(logs)

    before = os.sched_getaffinity(0)
    spec = SweepSpec(
        input_lens=(16,),
        fractions=(1.0,),
        repetitions=1,
        output_len=4,
        min_requests=2,
        max_requests=2,
        capacity_requests=2,
        pin_processes=True,
    )
    data = run_scenarios(spec, ("aggregated",), tmp_path, tmp_path / "w", start_stack=start)
    assert data["errors"] == {} and data["sweep"]["pin_processes"] is True
    assert seen == [{1}]
    assert os.sched_getaffinity(0) == before


def test_failed_stack_start_is_recorded(tmp_path: Path) -> None:
    def start(group: InstanceGroup, logs: Path) -> Any:
        raise RuntimeError("no vLLM here")

    data = run_scenarios(SweepSpec(), ("ours", "aggregated"), tmp_path, tmp_path / "w", start)
    assert set(data["errors"]) == {"ours", "aggregated"}
    assert "no vLLM here" in data["errors"]["ours"]
    assert data["rows"] == []


def test_stalled_capacity_run_is_capped_and_ends_that_stack(tmp_path: Path) -> None:
    """A backend slower than the time limit: its capacity run fails fast, no point runs."""
    slow: list[_FakeStack] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        slow.append(_FakeStack(logs, ttft_s=1.5))
        return slow[-1]

    spec = SweepSpec(
        input_lens=(16, 32),
        output_len=4,
        capacity_requests=2,
        num_warmups=0,
        point_time_limit_s=0.5,
    )
    data = run_scenarios(spec, ("aggregated",), tmp_path, tmp_path / "w", start_stack=start)
    assert data["rows"] == []
    assert [(c["input_len"], c["completed"], c["failed"]) for c in data["capacities"]] == [
        (16, 0, 2)
    ]
    assert "capacity at 16 tokens: no request completed" in data["errors"]["aggregated"]
    assert "time limit of 0.5 s" in data["errors"]["aggregated"]
    assert slow and slow[0].stopped


def test_wait_idle_polls_until_the_instances_report_no_requests() -> None:
    scrapes: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        scrapes.append(str(request.url))
        busy = 1 if len(scrapes) < 3 else 0
        body = f"vllm:num_requests_running 0.0\nvllm:num_requests_waiting {busy}.0\n"
        return httpx.Response(200, text=body)

    async def go() -> float:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await wait_idle(client, ["http://p/metrics"], timeout_s=60.0)

    waited = asyncio.run(go())
    assert len(scrapes) == 3 and waited < 60.0


def test_wait_idle_gives_up_at_its_bound() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="vllm:num_requests_running 2.0\n")

    async def go() -> float:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await wait_idle(client, ["http://p/metrics"], timeout_s=0.3)

    assert asyncio.run(go()) == 0.3


def test_sweep_spec_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="fractions must be positive"):
        SweepSpec(fractions=(0.5, 0.0))
    with pytest.raises(ValueError, match="repetitions"):
        SweepSpec(repetitions=0)
    assert SweepSpec().repetitions_of(0.9) == 2 and SweepSpec().repetitions_of(0.6) == 1


def test_spin_group_turns_the_progress_thread_on() -> None:
    group = GROUPS["ours-spin"]
    assert group.kind == "ours" and dict(group.connector_extra_config) == {
        "nixl_progress_thread": True
    }
    assert dict(GROUPS["ours"].connector_extra_config) == {}


def test_merge_keeps_untouched_stacks() -> None:
    from bench.scenarios import merge_previous

    previous = {
        "stacks": ["pull", "aggregated"],
        "rows": [{"stack": "pull", "x": 1}, {"stack": "aggregated", "x": 2}],
        "errors": {"aggregated": "old failure"},
        "timings": {"a": 1.0},
        "command": "first",
    }
    new = {
        "stacks": ["aggregated"],
        "rows": [{"stack": "aggregated", "x": 3}],
        "errors": {},
        "timings": {"b": 2.0},
    }
    merged = merge_previous(new, previous)
    assert merged["rows"] == [{"stack": "pull", "x": 1}, {"stack": "aggregated", "x": 3}]
    assert merged["errors"] == {}
    assert merged["stacks"] == ["pull", "aggregated"]
    assert merged["previous_commands"] == ["first"]


def test_accuracy_runs_the_real_and_emulated_passes_in_turns_per_input_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every set of instances starts once; at each input length the real pass, the emulated
    and the sleeping twins at the real one's loads, then the real one again; each compared."""
    import bench.emulator_accuracy as accuracy

    started: dict[str, list[_FakeStack]] = {"real": [], "emulated": [], "sleeping": []}

    def starter(kind: str, ttft_s: float) -> Any:
        def start(group: InstanceGroup, logs: Path) -> Any:
            started[kind].append(_FakeStack(logs, ttft_s))
            return started[kind][-1]

        return start

    turns: list[tuple[str, tuple[int, ...]]] = []

    def recorded(name: str, target: Any, spec: SweepSpec, out_dir: Path, *more: Any) -> Any:
        turns.append((out_dir.name, spec.input_lens))
        return sweep_one(name, target, spec, out_dir, *more)

    monkeypatch.setattr("bench.emulator_accuracy.sweep_one", recorded)
    spec = SweepSpec(
        input_lens=(16, 32),
        fractions=(0.5, 1.0),
        light_fraction=0.5,
        loaded_fraction=1.0,
        repetitions=1,
        output_len=4,
        min_requests=2,
        max_requests=2,
        capacity_requests=4,
    )
    starters = {
        "real": starter("real", 0.01),
        "emulated": starter("emulated", 0.02),
        "sleeping": starter("sleeping", 0.03),
    }
    data = accuracy.run_accuracy(
        spec,
        ("aggregated",),
        tmp_path,
        tmp_path / "w",
        real_runs=2,
        also_sleeping=True,
        starters=starters,
    )
    assert data["errors"] == {"real": {}, "emulated": {}, "sleeping": {}}
    assert [len(found) for found in started.values()] == [1, 1, 1]
    assert all(stack.stopped for found in started.values() for stack in found)
    order = ("real", "emulated", "sleeping", "real-2")
    assert turns == [(name, (n,)) for n in (16, 32) for name in order]
    real_capacity = {c["input_len"]: c["real_rps"] for c in data["capacities"]}
    for name in order[1:]:
        for point in (tmp_path / name / "runs").glob("*.json"):
            row = json.loads(point.read_text())
            assert row["rate"] == pytest.approx(row["fraction"] * real_capacity[row["input_len"]])
    points = {(p["input_len"], p["fraction"]) for p in data["points"]}
    assert points == {(n, f) for n in (16, 32) for f in (0.5, 1.0)}
    assert len(data["repeats"]["points"]) == len(data["sleeping"]["points"]) == 4
    # the sleeping fake answers later than the real one: its TTFT errors are positive
    assert all(p["error_mean_ttft_ms"] > 0 for p in data["sleeping"]["points"])
    assert set(data["summary"]) == {
        "emulator_cpu_point_error_max",
        "emulator_cpu_ratio_error_max",
        "emulator_sleeping_point_error_max",
        "emulator_sleeping_ratio_error_max",
        "real_repeat_point_error_max",
        "real_repeat_ratio_error_max",
    }


def test_a_salted_sweep_sends_prompts_of_its_own() -> None:
    spec = SweepSpec(output_len=4)
    first = sweep_prompts(spec, "ours", 64, 3, "f0.3/0", 4096)
    assert sweep_prompts(spec, "ours", 64, 3, "f0.3/0", 4096) == first
    again = sweep_prompts(replace(spec, prompt_salt="real-2/"), "ours", 64, 3, "f0.3/0", 4096)
    assert [r.prompt_len for r in again] == [r.prompt_len for r in first] == [64] * 3
    assert all(a.prompt != b.prompt for a, b in zip(again, first, strict=True))
