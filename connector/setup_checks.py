"""Start-up refusals: the vLLM setups the connector does not support fail at once, with a reason.

Who calls it: the facade, once per role, before anything is registered. It reads vLLM's config
objects by attribute (no vLLM import), so it is unit-tested with plain stand-ins.
"""

from __future__ import annotations

from typing import Any

from connector.errors import UnsupportedSetupError


def refuse_unsupported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise :class:`UnsupportedSetupError` for PP > 1, an MLA model, or more than one KV cache
    group (hybrid attention); each message names the setting and its value. Tensor parallelism
    is supported (each rank moves its own KV heads; see the README, "Tensor parallelism")."""
    parallel = vllm_config.parallel_config
    size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if size != 1:
        raise UnsupportedSetupError(
            f"pipeline_parallel_size={size}: DisaggPushConnector supports pipeline parallel "
            "size 1 on P and D (tensor parallel is supported)"
        )
    model = getattr(vllm_config, "model_config", None)
    if model is not None and bool(getattr(model, "use_mla", False)):
        raise UnsupportedSetupError(
            "the model uses MLA (latent KV cache): DisaggPushConnector moves standard "
            "attention KV caches only"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) != 1:
        raise UnsupportedSetupError(
            f"{len(groups)} KV cache groups (hybrid or sliding-window attention): "
            "DisaggPushConnector supports models with one KV cache group"
        )
