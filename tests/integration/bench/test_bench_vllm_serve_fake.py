"""``disagg-bench vllm-serve``'s client run: the real ``vllm.benchmarks.serve`` module (vLLM's
``vllm bench serve``) in a child process against the one fake vLLM, a handful of requests."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from bench.client import Target
from bench.vllm_serve import ClientRun, ServeRecipe, run_point
from devstack.ports import free_port
from devstack.process import http_process
from devstack.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM (its benchmark client)"
)


def test_vllm_bench_serve_module_runs_against_the_fake(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "devstack.fake_vllm", "--port", str(port)]
    argv += ["--model", "fake-model", "--token-delay", "0.001"]
    fake = http_process("fake", argv, f"http://127.0.0.1:{port}/health", tmp_path / "fake.log")
    recipe = ServeRecipe(input_len=64, output_len=6, rates=(20.0,), num_prompts=4, num_warmups=1)
    target = Target(
        f"http://127.0.0.1:{port}",
        "fake-model",
        metrics=(("a", f"http://127.0.0.1:{port}/metrics"),),
    )
    run = ClientRun(
        "ours", target, make_tiny_model(tmp_path / "tiny"), 20.0, 3, tmp_path / "r.json"
    )
    with fake:
        row = run_point(run, recipe, tmp_path / "out", tmp_path / "client.log")
    assert row["errors"] == [], (tmp_path / "client.log").read_text()[-3000:]
    assert row["completed"] == 4 and row["failed"] == 0 and row["num_prompts"] == 4
    # --ignore-eos and the usage chunk: every request produced exactly the recipe's tokens
    assert row["output_lens"] == {"min": 6, "max": 6} and row["total_output_tokens"] == 24
    assert row["mean_ttft_ms"] > 0 and row["p99_tpot_ms"] > 0 and row["median_e2el_ms"] > 0
    kept = json.loads((tmp_path / "out" / "runs" / "ours_rate20.json").read_text())
    assert kept["request_rate"] == 20.0 and kept["label"] == "ours"
    assert "ttfts" not in kept and "generated_texts" not in kept  # trimmed
    detailed = json.loads((tmp_path / "r.json").read_text())
    assert len(detailed["ttfts"]) == 4
