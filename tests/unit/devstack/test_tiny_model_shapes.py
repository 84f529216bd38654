"""The tiny model's other shapes (hybrid attention, MLA) load as what they claim to be.

Each shape directory is made once per module (the weights are built through ``transformers``,
a few seconds each). ``transformers``' ``AutoConfig`` must read each config as its model family,
and vLLM's ``ModelConfig`` must see the property the connector's start-up checks care about
(MLA or not, sliding-window layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devstack.tiny_model import (
    MODEL_FILES,
    SHAPES,
    SLIDING_WINDOW,
    ModelShape,
    is_complete,
    make_tiny_model,
    model_config,
)

OTHER_SHAPES: tuple[ModelShape, ...] = ("gemma3", "deepseek_v2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("shapes")
    return {shape: make_tiny_model(root / shape, shape) for shape in SHAPES}


def test_every_shape_shares_the_llama_tokenizer(models: dict[str, Path]) -> None:
    for shape in OTHER_SHAPES:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (models[shape] / name).read_bytes() == (models["llama"] / name).read_bytes()
        assert all((models[shape] / name).is_file() for name in MODEL_FILES)


def test_gemma3_config_loads_as_hybrid_sliding_window_model(models: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(models["gemma3"]))
    assert type(config).__name__ == "Gemma3TextConfig"
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.sliding_window == SLIDING_WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.vocab_size == model_config()["vocab_size"]


def test_deepseek_v2_config_loads_as_mla_model_without_moe(models: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(models["deepseek_v2"]))
    assert type(config).__name__ == "DeepseekV2Config"
    assert config.architectures == ["DeepseekV2ForCausalLM"]
    # vLLM's CPU MLA kernel takes a 576-wide latent cache only.
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576
    assert config.first_k_dense_replace >= config.num_hidden_layers  # every MLP dense


def test_weights_are_deterministic_and_named_for_the_model_class(
    models: dict[str, Path], tmp_path: Path
) -> None:
    safetensors = pytest.importorskip("safetensors")
    again = make_tiny_model(tmp_path / "again", "deepseek_v2")
    first = models["deepseek_v2"] / "model.safetensors"
    assert (again / "model.safetensors").read_bytes() == first.read_bytes()
    with safetensors.safe_open(str(first), "pt") as weights:
        names = set(weights.keys())
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.1.self_attn.kv_b_proj.weight" in names
    assert not any(".experts." in name for name in names)


def test_a_directory_of_another_shape_is_replaced(models: dict[str, Path], tmp_path: Path) -> None:
    dest = make_tiny_model(tmp_path / "m")
    assert is_complete(dest) and not is_complete(dest, "gemma3")
    make_tiny_model(dest, "gemma3")
    assert is_complete(dest, "gemma3") and not is_complete(dest)
    assert json.loads((dest / "config.json").read_text())["model_type"] == "gemma3_text"


def test_unknown_shape_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"gpt2.*llama, gemma3, deepseek_v2"):
        model_config("gpt2")  # type: ignore[arg-type]


def test_vllm_sees_mla_and_the_sliding_window(models: dict[str, Path]) -> None:
    """What the connector's start-up checks read: ``use_mla`` and the per-layer window."""
    vllm_config = pytest.importorskip("vllm.config")
    gemma = vllm_config.ModelConfig(model=str(models["gemma3"]))
    assert not gemma.use_mla
    assert gemma.get_sliding_window() == SLIDING_WINDOW
    deepseek = vllm_config.ModelConfig(model=str(models["deepseek_v2"]))
    assert deepseek.use_mla
    assert deepseek.get_head_size() == 576
