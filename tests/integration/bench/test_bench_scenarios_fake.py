"""The scenario runner's flow (stack start, sweep, per-point JSON, report) on a fake instance."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import render
from bench.scenarios import GROUPS, InstanceGroup, SweepSpec, run_scenarios
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


def test_runner_sweeps_and_reports(tmp_path: Path) -> None:
    started: list[_FakeStack] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        assert group.topology == "aggregated"
        started.append(_FakeStack(logs))
        return started[-1]

    spec = SweepSpec(
        input_lens=(16, 32),
        rates=(50.0,),
        output_len=4,
        min_requests=3,
        max_requests=3,
        num_warmups=1,
    )
    data = run_scenarios(spec, ("aggregated",), tmp_path, tmp_path / "work", start_stack=start)
    assert data["errors"] == {}
    assert started and started[0].stopped
    assert [(r["input_len"], r["metrics"]["completed"]) for r in data["rows"]] == [(16, 3), (32, 3)]
    run_file = tmp_path / "runs" / "aggregated_in16_r50.json"
    assert json.loads(run_file.read_text())["metrics"]["total_output_tokens"] == 12
    (tmp_path / "scenarios.json").write_text(json.dumps(data))
    from bench.scenarios_cmd import rows_from_runs

    assert rows_from_runs(tmp_path) == json.loads(json.dumps(data["rows"]))
    summary = render(tmp_path, "test")
    assert summary["ttft_push_over_pull_loaded"] is None  # only the aggregated stack ran


def test_failed_stack_start_is_recorded(tmp_path: Path) -> None:
    def start(group: InstanceGroup, logs: Path) -> Any:
        raise RuntimeError("no vLLM here")

    data = run_scenarios(SweepSpec(), ("ours", "aggregated"), tmp_path, tmp_path / "w", start)
    assert set(data["errors"]) == {"ours", "aggregated"}
    assert "no vLLM here" in data["errors"]["ours"]
    assert data["rows"] == []


def test_stalled_point_is_capped_and_ends_that_stack(tmp_path: Path) -> None:
    """A backend slower than the point's time limit: the point fails fast, later points skip."""
    slow: list[_FakeStack] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        # warm-up passes (its limit is generous), sweep points are capped far below the TTFT
        slow.append(_FakeStack(logs, ttft_s=1.5))
        return slow[-1]

    spec = SweepSpec(
        input_lens=(16, 32),
        rates=(50.0, 100.0),
        output_len=4,
        min_requests=2,
        max_requests=2,
        num_warmups=0,
        point_time_limit_s=0.5,
    )
    data = run_scenarios(spec, ("aggregated",), tmp_path, tmp_path / "w", start_stack=start)
    assert [r["rate"] for r in data["rows"]] == [50.0]  # later points never ran
    row = data["rows"][0]
    assert row["metrics"]["completed"] == 0 and row["metrics"]["failed"] == 2
    assert "time limit of 0.5 s" in row["errors"][0]
    assert "completed no request" in data["errors"]["aggregated"]
    assert slow and slow[0].stopped


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
