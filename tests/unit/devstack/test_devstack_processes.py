"""VllmServer process handling and the tiny model, without vLLM.

The server lifecycle runs a stand-in process (an HTTP server answering /health that forks a child,
as vLLM's API server forks its engine core), so start, readiness, fail-fast and group kill are
exercised for real in seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from devstack.ports import free_port
from devstack.process import pid_alive
from devstack.tiny_model import CHAT_TEMPLATE, MODEL_FILES, make_tiny_model
from devstack.vllm_server import VllmServer, VllmServerError, VllmServerSpec, start_servers
from tests.support.stand_in import HTTP_STAND_IN, wait_dead


def _spec(
    tmp_path: Path, name: str, behaviour: str, monkeypatch: pytest.MonkeyPatch
) -> VllmServerSpec:
    script = tmp_path / "stand_in.py"
    script.write_text(HTTP_STAND_IN)

    def command(self: VllmServerSpec) -> list[str]:
        return [
            sys.executable,
            str(script),
            str(self.port),
            str(tmp_path / f"{self.name}.child"),
            behaviour,
        ]

    monkeypatch.setattr(VllmServerSpec, "command", command)
    return VllmServerSpec(
        name=name,
        model_dir=tmp_path,
        port=free_port(),
        cpu_core=0,
        log_file=tmp_path / f"{name}.log",
    )


def test_start_wait_and_stop_kill_the_whole_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path, "s0", "serve", monkeypatch)
    servers = start_servers([spec], timeout_s=30)
    server = servers[0]
    assert server.is_alive()
    child_pid = int((tmp_path / "s0.child").read_text())
    assert pid_alive(child_pid)
    server.stop(grace_s=5)
    assert not server.is_alive()
    assert wait_dead(child_pid), "the forked child outlived stop()"
    server.stop()  # idempotent


def test_a_dying_server_fails_fast_with_its_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path, "s1", "die", monkeypatch)
    with pytest.raises(VllmServerError, match=r"(?s)exited with 3:.*stand-in failed on purpose"):
        start_servers([spec], timeout_s=60)  # the exit, not the 60 s bound, ended the wait
    child_pid = int((tmp_path / "s1.child").read_text())
    assert wait_dead(child_pid), "start_servers left the failed server's child running"


def test_wait_ready_times_out_with_the_server_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path, "s2", "serve", monkeypatch)
    server = VllmServer(spec)
    # Not started: polling reports that clearly.
    with pytest.raises(VllmServerError, match="not started"):
        server.wait_ready(timeout_s=1)


def test_tiny_model_is_complete_deterministic_and_idempotent(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a")
    second = make_tiny_model(tmp_path / "b")
    for name in MODEL_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert make_tiny_model(first) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 128
    assert config["num_key_value_heads"] == 2
    assert config["max_position_embeddings"] >= 16384
    tokenizer_config = json.loads((first / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_tiny_model_tokenizer_round_trips_and_renders_chat(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = make_tiny_model(tmp_path / "m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    text = "Hello there, 123 quick foxes! Ünïcode ok?"
    ids = tokenizer(text)["input_ids"]
    assert 0 < len(ids) < len(text)
    assert max(ids) < json.loads((model / "config.json").read_text())["vocab_size"]
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<s><|user|>hi</s><|assistant|>"
