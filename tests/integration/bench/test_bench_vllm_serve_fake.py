"""``disagg-bench vllm-serve``'s flow on fakes: a 1P1D pair of the one fake vLLM as the stack, our
router in front (started as the benchmark starts it), warm-up, then the real
``vllm.benchmarks.serve`` module (vLLM's ``vllm bench serve``) as a child process, a handful of
requests; its result JSON parsed and kept trimmed."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.routers import router_config
from bench.scenarios import InstanceGroup
from bench.vllm_serve import ServeRecipe, run_serve_benchmark
from devstack.ports import free_ports
from devstack.process import ChildProcess, http_process, start_all, stop_all
from devstack.tiny_model import make_tiny_model

# vLLM's benchmark client takes about 20 s of CPU to import: it runs in the vllm suite.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM (its benchmark client)"
    ),
]
MODEL = "fake-model"
ENGINE_ID = "fake-p0"


@dataclass
class _Instance:
    url: str


class _FakePair:
    """Stands in for a devstack 1P1D stack: a prefill and a decode fake vLLM process."""

    model_name = MODEL

    def __init__(self, logs: Path, model_dir: Path) -> None:
        self.model_dir = model_dir
        p_port, d_port, self.nixl_port = free_ports(3)
        self.procs = [
            self._fake("p0", p_port, logs, ["--engine-id", ENGINE_ID]),
            self._fake("d0", d_port, logs, []),
        ]
        start_all(self.procs, 60.0)
        self.prefill = [_Instance(f"http://127.0.0.1:{p_port}")]
        self.decode = [_Instance(f"http://127.0.0.1:{d_port}")]
        self.stopped = False

    @staticmethod
    def _fake(name: str, port: int, logs: Path, extra: list[str]) -> ChildProcess:
        argv = [sys.executable, "-m", "devstack.fake_vllm", "--port", str(port), "--model", MODEL]
        argv += ["--token-delay", "0.001", *extra]
        return http_process(name, argv, f"http://127.0.0.1:{port}/health", logs / f"{name}.log")

    def router_config(self, with_identity: bool = False) -> dict[str, Any]:
        identity = {"engine_id": ENGINE_ID, "host": "127.0.0.1", "port": self.nixl_port}
        return router_config(MODEL, self.prefill[0].url, self.decode[0].url, identity=identity)

    def stop(self) -> None:
        stop_all(self.procs)
        self.stopped = True


def test_vllm_bench_serve_runs_through_our_router_on_fakes(tmp_path: Path) -> None:
    started: list[_FakePair] = []

    def start(group: InstanceGroup, logs: Path) -> Any:
        assert group.kind == "ours" and group.topology == "1p1d"
        started.append(_FakePair(logs, make_tiny_model(tmp_path / "tiny")))
        return started[-1]

    recipe = ServeRecipe(input_len=64, output_len=6, rates=(20.0,), num_prompts=4, seed=3)
    out, work = tmp_path / "out", tmp_path / "work"
    result = run_serve_benchmark(recipe, ("ours",), out, work, start_stack=start)
    log = (work / "ours" / "ours_rate20.log").read_text()[-3000:]
    assert result["errors"] == {}, log
    assert started and started[0].stopped
    [row] = result["points"]
    assert row["errors"] == [], log
    assert (row["stack"], row["rate"], row["completed"], row["failed"]) == ("ours", 20.0, 4, 0)
    # --ignore-eos and the usage chunk: every request produced exactly the recipe's tokens
    assert row["output_lens"] == {"min": 6, "max": 6} and row["total_output_tokens"] == 24
    assert row["mean_ttft_ms"] > 0 and row["p99_tpot_ms"] > 0 and row["median_e2el_ms"] > 0
    # what the point saw beside the client: our router's stages and its CPU over the run
    assert row["router_stages_ms"]["accept_to_legs_sent"] > 0
    assert row["processes"]["router"]["cpu_s"] > 0
    kept = json.loads((out / "runs" / "ours_rate20.json").read_text())
    assert kept["request_rate"] == 20.0 and kept["label"] == "ours" and kept["num_prompts"] == 4
    assert kept["tokenizer_id"] == "tiny" and "ttfts" not in kept  # trimmed, no local path
    assert len(json.loads((work / "ours" / "ours_rate20.json").read_text())["ttfts"]) == 4
