"""A tiny Llama-shaped model directory made on the fly, with no downloads.

Who calls it: the e2e test fixtures, the demo, the benchmarks and the deploy scripts, before they
start vLLM. The directory holds seeded random weights (``model.safetensors``, ~3 MB), so two
instances serving it compute identical outputs (verified in the e2e suite). It also works with
``--load-format dummy``, but vLLM's dummy weights (uniform +-1e-3) make the model repeat one token
whatever the prompt, so a broken KV transfer would go unnoticed; the devstack therefore loads the
real file by default.

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
from typing import Any

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


def model_config() -> dict[str, Any]:
    """The ``config.json`` contents: a 2-layer Llama with GQA (4 query heads, 2 KV heads)."""
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


def is_complete(dest: Path) -> bool:
    """True when ``dest`` holds a model of the current format version."""
    config = dest / "config.json"
    if not all((dest / name).is_file() for name in MODEL_FILES):
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return bool(data.get("disagg_router_tiny_model_version") == _FORMAT_VERSION)


def make_tiny_model(dest: Path) -> Path:
    """Create the tiny model directory at ``dest`` unless it is already complete; return ``dest``.

    Safe to call concurrently: the files are written into a temporary sibling directory that is
    renamed into place; a loser of the rename race discards its copy.
    """
    dest = Path(dest)
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        config = model_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_weights(tmp / "model.safetensors", config)
        (tmp / "tokenizer.json").write_text(_train_tokenizer_json())
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(_generation_config(), indent=2) + "\n"
        )
        if dest.exists() and not is_complete(dest):
            shutil.rmtree(dest)
        try:
            tmp.rename(dest)
        except OSError:
            if not is_complete(dest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
