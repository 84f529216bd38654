"""Start-up refusals: the vLLM setups the connector does not support fail at once, with a reason.

Who calls it: the facade, once per role, before anything is registered (and for the KV head
count of a worker's layout, :func:`connector_kv_heads`). It reads vLLM's config
objects by attribute (no vLLM import), so it is unit-tested with plain stand-ins.
"""

from __future__ import annotations

from typing import Any

from disagg_router.connector.errors import UnsupportedSetupError


def connector_kv_heads(model_config: Any) -> int:
    """The KV heads of the model as the connector counts them (all TP ranks together).

    Who calls it: the facade, for the worker's layout (``total_kv_heads``, which decides what
    each P rank writes into which D rank). The engine shape the legs report keeps vLLM's own
    count. An MLA model counts 1: its latent cache is one "head" that every TP rank holds whole
    (vLLM's ``get_num_kv_heads`` is 1 per rank for MLA, while ``get_total_num_kv_heads`` reports
    the attention's KV heads, which no rank's cache is split by).
    Fewer heads than ranks means replicas: P's TP rank 0 is the one source of every D rank and
    P's other ranks send nothing (:func:`disagg_router.connector.layout.head_sources`).
    """
    if bool(getattr(model_config, "use_mla", False)):
        return 1
    return int(model_config.get_total_num_kv_heads())


def refuse_unsupported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise :class:`UnsupportedSetupError` for PP > 1 on a consumer (D) or more than one KV cache
    group; each message names the setting, its value and why.

    Tensor parallelism on P and on D is supported, equal or different when one size divides the
    other (each P rank writes its KV heads into the D ranks holding them; see the README,
    "Tensor parallelism"), and so is pipeline parallelism on P (each stage writes its own
    layers into D's regions of the same layers, "Pipeline parallelism"). Hybrid sliding-window
    + full attention models (e.g. Gemma-3) pass: this connector does not implement
    ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off and keeps every layer in one
    full-attention KV cache group. MLA models pass at any TP size and, on P, any PP size: one
    latent tensor per layer, moved like any other region, and with TP > 1 the latent cache is
    one KV head replicated on every rank (:func:`connector_kv_heads`).
    """
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
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
