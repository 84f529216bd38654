"""The commands ``disagg-demo --serve`` prints work as pasted against an OpenAI endpoint.

The endpoint here is the one fake vLLM (it answers chat like vLLM does); the demo itself, on real
vLLM, is the README's first command.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from devstack.demo import client_commands
from devstack.fake_vllm import FakeVllmState, fake_vllm


def _run(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)


def test_curl_and_openai_commands_get_an_answer(tmp_path: Path) -> None:
    state = FakeVllmState()
    with fake_vllm(state) as srv:
        curl, sdk, _bench = client_commands(srv.url, "fake-model", tmp_path)
        curl_out = _run(curl)
        sdk_out = _run(sdk)
    assert curl_out.returncode == 0, curl_out.stderr
    assert '"chat.completion"' in curl_out.stdout
    assert sdk_out.returncode == 0, sdk_out.stderr
    assert "tok0" in sdk_out.stdout
    bodies = [r.body for r in state.generation_requests()]
    assert [b["model"] for b in bodies] == ["fake-model", "fake-model"]
    assert all(0 < b["max_tokens"] <= 64 for b in bodies)  # a random-weights model never stops


def test_bench_command_names_the_endpoint_model_and_tokenizer(tmp_path: Path) -> None:
    bench = client_commands("http://127.0.0.1:9", "m", tmp_path / "tiny model")[2]
    assert "vllm.benchmarks.serve" in bench
    assert "--base-url http://127.0.0.1:9 --model m" in bench
    assert f"--tokenizer '{tmp_path / 'tiny model'}'" in bench
    assert "--random-output-len 32" in bench
