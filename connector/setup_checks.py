"""Start-up refusals: the vLLM setups the connector does not support fail at once, with a reason.

Who calls it: the facade, once per role, before anything is registered. It reads vLLM's config
objects by attribute (no vLLM import), so it is unit-tested with plain stand-ins.
"""

from __future__ import annotations

from typing import Any

from connector.errors import UnsupportedSetupError


def refuse_unsupported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise :class:`UnsupportedSetupError` for PP > 1 on a consumer (D), MLA with TP or PP > 1,
    or more than one KV cache group; each message names the setting, its value and why.

    Tensor parallelism on P and on D is supported, equal or different when one size divides the
    other (each P rank writes its KV heads into the D ranks holding them; see the README,
    "Tensor parallelism"), and so is pipeline parallelism on P (each stage writes its own
    layers into D's regions of the same layers, "Pipeline parallelism"). Hybrid sliding-window
    + full attention models (e.g. Gemma-3) pass: this connector does not implement
    ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off and keeps every layer in one
    full-attention KV cache group. MLA models pass with TP = PP = 1 (one latent tensor per
    layer, moved like any other region).
    """
    parallel = vllm_config.parallel_config
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    model = getattr(vllm_config, "model_config", None)
    if (tp != 1 or pp != 1) and model is not None and bool(getattr(model, "use_mla", False)):
        raise UnsupportedSetupError(
            f"the model uses MLA with tensor_parallel_size={tp}, pipeline_parallel_size={pp}: "
            "every TP rank holds the whole latent KV cache, and DisaggPushConnector moves MLA "
            "caches with TP 1 and PP 1 only (MLA with pipeline parallel is not verified)"
        )
    role = str(getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", ""))
    if pp != 1 and role != "kv_producer":
        raise UnsupportedSetupError(
            f"pipeline_parallel_size={pp} with kv_role={role!r}: D registers its whole model's KV "
            "cache from one worker per TP rank; pipeline parallel size must be 1 on D (P may "
            "be pipeline parallel)"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) != 1:
        raise UnsupportedSetupError(
            f"{len(groups)} KV cache groups: vLLM kept several groups with its hybrid KV cache "
            "manager off (e.g. an SSM/Mamba hybrid); DisaggPushConnector does not implement "
            "SupportsHMA and moves models with one KV cache group"
        )
