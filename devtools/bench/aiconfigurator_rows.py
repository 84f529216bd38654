"""Step times of a GPU model from aiconfigurator's estimator, as rows the emulator's profile fit
reads (``disagg-bench fit-profile --rows``).

Who runs it: a person, with the Python of an environment where ``aiconfigurator`` (package
index) is installed, since its dependencies (numpy >= 2.1, pandas, pyarrow, plotly) are not the
router's. It imports nothing of this repository, only ``aiconfigurator_core``, and prints one
JSON object: the setting, the model's KV bytes per token (from aiconfigurator's model config),
and rows of estimated seconds:

- ``prefill``: one request alone, a prompt of ``length`` tokens in one step (lengths up to
  ``max_num_batched_tokens``; a longer prompt is chunked by the fit);
- ``decode``: one decode step of ``batch`` sequences of ``context`` tokens each.

Example: ``/path/to/aiconfigurator-env/bin/python devtools/bench/aiconfigurator_rows.py --model
Qwen/Qwen3-32B --system h200_sxm --backend vllm --tp 1 > rows.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PREFILL_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128)
DECODE_CONTEXTS = (1024, 4096, 16384)


def _kv_bytes_per_token(model: str, tp: int) -> int:
    """K and V of every layer for one token on one of ``tp`` ranks, 2-byte elements."""
    import aiconfigurator_core

    name = model.replace("/", "--") + "_config.json"
    path = Path(aiconfigurator_core.__file__).parent / "model_configs" / name
    config: dict[str, Any] = json.loads(path.read_text())
    heads = max(1, int(config["num_key_value_heads"]) // tp)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * int(config["num_hidden_layers"]) * heads * head_dim * 2


def rows(model: str, system: str, backend: str, tp: int, chunk: int) -> list[dict[str, Any]]:
    from aiconfigurator_core.sdk.engine import EngineHandle

    engine = EngineHandle.compile(model, system, backend, tp_size=tp)
    out: list[dict[str, Any]] = []
    for length in (n for n in PREFILL_LENGTHS if n <= chunk):
        ms = engine.predict_prefill_latency(1, length)
        out.append({"kind": "prefill", "length": length, "seconds": ms / 1000})
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            ms = engine.decode_step_latency(batch, context, 2)
            out.append({"kind": "decode", "batch": batch, "context": context, "seconds": ms / 1000})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-32B")
    parser.add_argument("--system", default="h200_sxm")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args(argv)
    from importlib.metadata import version

    found = rows(args.model, args.system, args.backend, args.tp, args.max_num_batched_tokens)
    data = {
        "estimator": f"aiconfigurator {version('aiconfigurator')}",
        "model": args.model,
        "system": args.system,
        "backend": args.backend,
        "tp": args.tp,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_bytes_per_token": _kv_bytes_per_token(args.model, args.tp),
        "rows": found,
    }
    json.dump(data, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
