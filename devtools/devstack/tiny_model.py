"""A tiny model directory made on the fly, with no downloads: Llama-shaped, or another shape.

Who calls it: the e2e test fixtures, the demo, the benchmarks and the deploy scripts, before they
start vLLM. The directory holds seeded random weights (``model.safetensors``, ~3 MB), so two
instances serving it compute identical outputs (verified in the e2e suite). It also works with
``--load-format dummy``, but vLLM's dummy weights (uniform +-1e-3) make the model repeat one token
whatever the prompt, so a broken KV transfer would go unnoticed; the devstack therefore loads the
real file by default.

Shapes (:data:`SHAPES`; every one uses the same tokenizer, vocabulary and special tokens):

* ``llama`` (the default): 2-layer Llama with GQA, one standard attention KV cache per layer.
* ``gemma3``: 2-layer ``Gemma3ForCausalLM`` text model, one sliding-window layer
  (:data:`SLIDING_WINDOW` tokens) and one full-attention layer (``layer_types``), i.e. a hybrid
  attention model (two KV cache groups when vLLM's hybrid KV cache manager is on).
* ``deepseek_v2``: 2-layer ``DeepseekV2ForCausalLM`` with MLA (one latent KV tensor per layer,
  ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576, the only size vLLM's CPU MLA kernel
  takes), dense MLPs only (``first_k_dense_replace`` = the layer count, so no MoE layer).

The non-Llama weights are named by ``transformers`` (the model class built from the config,
which is what vLLM's loaders expect) and filled with seeded random values like the Llama's
(the norms keep that class's constant initial values).

Contract: :func:`make_tiny_model` is idempotent and deterministic. It writes ``config.json``,
``tokenizer.json`` (a byte-level BPE trained with ``tokenizers`` on generated text),
``tokenizer_config.json`` (with a chat template so ``/v1/chat/completions`` works),
``generation_config.json`` and ``model.safetensors`` into a temporary sibling and renames it into
place, so concurrent callers never see a half-written directory. It never touches the network.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

ModelShape = Literal["llama", "gemma3", "deepseek_v2"]
SHAPES: tuple[ModelShape, ...] = ("llama", "gemma3", "deepseek_v2")
SLIDING_WINDOW = 64
"""Tokens the ``gemma3`` shape's sliding-window layer attends to (well below the prompts the
e2e suite sends, so a missing or misplaced block changes the output)."""
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 32768
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, "<|user|>", "<|assistant|>", "<|system|>")
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "model.safetensors",
)
_FORMAT_VERSION = 2
_SHAPE_KEY = "disagg_router_tiny_model_shape"
WEIGHT_SEED = 20260101
# Standard deviations of the random weights. Larger than vLLM's dummy init (uniform +-1e-3, which
# makes every output a repetition of one token regardless of context) so that attention over the
# prompt visibly shapes the output: a KV transfer that delivers wrong blocks changes the text.
_EMBED_STD = 1.0
_PROJ_STD = 0.08
_QK_STD = 0.25

# Role markers are added as special tokens; the template emits them verbatim.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_ONSETS = ("b", "d", "f", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl", "qu")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ee")
_CODAS = ("", "n", "r", "s", "t", "x", "ck", "ng")
# Pseudo-words: every onset/nucleus/coda combination (1024 of them), in a fixed order.
_WORDS = tuple(o + n + c for o in _ONSETS for n in _NUCLEI for c in _CODAS)


def model_config(shape: ModelShape = "llama") -> dict[str, Any]:
    """The ``config.json`` contents of ``shape`` (see the module docstring)."""
    if shape == "gemma3":
        return _gemma3_config()
    if shape == "deepseek_v2":
        return _deepseek_v2_config()
    if shape != "llama":
        raise ValueError(f"unknown tiny model shape {shape!r}; known: {', '.join(SHAPES)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
        "disagg_router_tiny_model_version": _FORMAT_VERSION,
    }


def _common(shape: ModelShape) -> dict[str, Any]:
    """Keys every non-Llama shape shares with the Llama (vocabulary, tokens, dtype, marker)."""
    return {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "attention_bias": False,
        "use_cache": True,
        "disagg_router_tiny_model_version": _FORMAT_VERSION,
        _SHAPE_KEY: shape,
    }


def _gemma3_config() -> dict[str, Any]:
    """Gemma-3 text model: layer 0 sliding-window, layer 1 full attention."""
    return {
        **_common("gemma3"),
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _deepseek_v2_config() -> dict[str, Any]:
    """DeepSeek-V2 with MLA and no MoE layer (all layers below ``first_k_dense_replace``)."""
    return {
        **_common("deepseek_v2"),
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "first_k_dense_replace": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
    }


def _write_weights(path: Path, config: dict[str, Any]) -> None:
    """Write seeded random bf16 weights for :func:`model_config` as safetensors (a few MB)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    head_dim = int(config["head_dim"])
    q_out = int(config["num_attention_heads"]) * head_dim
    kv_out = int(config["num_key_value_heads"]) * head_dim
    vocab = int(config["vocab_size"])

    def randn(std: float, *shape: int) -> Any:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    tensors: dict[str, Any] = {
        "model.embed_tokens.weight": randn(_EMBED_STD, vocab, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": randn(_PROJ_STD, vocab, hidden),
    }
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"model.layers.{layer}"
        tensors.update(
            {
                f"{prefix}.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                f"{prefix}.post_attention_layernorm.weight": torch.ones(
                    hidden, dtype=torch.bfloat16
                ),
                f"{prefix}.self_attn.q_proj.weight": randn(_QK_STD, q_out, hidden),
                f"{prefix}.self_attn.k_proj.weight": randn(_QK_STD, kv_out, hidden),
                f"{prefix}.self_attn.v_proj.weight": randn(_PROJ_STD, kv_out, hidden),
                f"{prefix}.self_attn.o_proj.weight": randn(_PROJ_STD, hidden, q_out),
                f"{prefix}.mlp.gate_proj.weight": randn(_PROJ_STD, inter, hidden),
                f"{prefix}.mlp.up_proj.weight": randn(_PROJ_STD, inter, hidden),
                f"{prefix}.mlp.down_proj.weight": randn(_PROJ_STD, hidden, inter),
            }
        )
    save_file(tensors, str(path), metadata={"format": "pt"})


# Weight names whose values scale attention logits get the larger standard deviation.
_QK_NAMES = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _weight_std(name: str) -> float:
    if "embed_tokens" in name:
        return _EMBED_STD
    return _QK_STD if any(f".{part}." in name for part in _QK_NAMES) else _PROJ_STD


def _write_transformers_weights(path: Path, model_dir: Path) -> None:
    """Write seeded random bf16 weights for the ``config.json`` in ``model_dir``.

    The tensor names and shapes come from the ``transformers`` model class built from that
    config (no download); every matrix gets seeded normal values like the Llama's, every vector
    (the norms) keeps that class's initial value, which is a constant.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    tensors: dict[str, Any] = {}
    for name, value in sorted(model.state_dict().items()):
        if value.dim() >= 2:
            values = torch.randn(*value.shape, generator=generator) * _weight_std(name)
        else:
            values = value.detach().clone()
        tensors[name] = values.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _training_corpus(seed: int = 1234, lines: int = 4000) -> Iterator[str]:
    """Deterministic pseudo-text: words, numbers and punctuation."""
    rng = random.Random(seed)
    for _ in range(lines):
        n = rng.randint(5, 30)
        parts: list[str] = []
        for _ in range(n):
            r = rng.random()
            if r < 0.8:
                parts.append(rng.choice(_WORDS))
            elif r < 0.95:
                parts.append(str(rng.randint(0, 9999)))
            else:
                parts.append(rng.choice([",", ".", "?", "!", ":", "-"]))
        yield " ".join(parts)


def _train_tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer and return its JSON serialization."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # single-threaded training is reproducible
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    result: str = tokenizer.to_str()
    return result


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def _generation_config() -> dict[str, Any]:
    return {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def is_complete(dest: Path, shape: ModelShape = "llama") -> bool:
    """True when ``dest`` holds a ``shape`` model of the current format version."""
    config = dest / "config.json"
    if not all((dest / name).is_file() for name in MODEL_FILES):
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    if data.get(_SHAPE_KEY, "llama") != shape:
        return False
    return bool(data.get("disagg_router_tiny_model_version") == _FORMAT_VERSION)


def make_tiny_model(dest: Path, shape: ModelShape = "llama") -> Path:
    """Create the tiny ``shape`` model directory at ``dest`` unless it is already complete;
    return ``dest``. A directory holding another shape is replaced.

    Safe to call concurrently: the files are written into a temporary sibling directory that is
    renamed into place; a loser of the rename race discards its copy.
    """
    dest = Path(dest)
    if is_complete(dest, shape):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        config = model_config(shape)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if shape == "llama":
            _write_weights(tmp / "model.safetensors", config)
        else:
            _write_transformers_weights(tmp / "model.safetensors", tmp)
        (tmp / "tokenizer.json").write_text(_train_tokenizer_json())
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(_generation_config(), indent=2) + "\n"
        )
        if dest.exists() and not is_complete(dest, shape):
            shutil.rmtree(dest)
        try:
            tmp.rename(dest)
        except OSError:
            if not is_complete(dest, shape):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
