"""``DisaggPushConnector``: the thin class vLLM loads; it only delegates.

Who calls it: vLLM (``KVConnectorFactory`` with
``kv_connector_module_path="disagg_router.connector"``), once per role: in the scheduler process
with ``KVConnectorRole.SCHEDULER`` and in each worker with ``KVConnectorRole.WORKER``. Scheduler
hooks go to :class:`~disagg_router.connector.scheduler.PushScheduler`, worker hooks to
:class:`~disagg_router.connector.worker.PushWorker`. Both worker result APIs are provided:
``get_finished`` (vLLM <= 0.32 style; failures via ``get_block_ids_with_load_errors``) and
``get_transfer_results`` (vLLM >= 0.32; failures via ``failed_recving``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.metadata import PushConnectorMetadata
from disagg_router.connector.setup_checks import connector_kv_heads, refuse_unsupported
from disagg_router.connector.stats import PushPromMetrics, PushTransferStats

try:  # vLLM >= 0.32
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None

if TYPE_CHECKING:
    import torch

    from disagg_router.connector.scheduler import PushScheduler
    from disagg_router.connector.worker import PushWorker, WorkerStep

logger = logging.getLogger(__name__)


def _attach_vllm_logging() -> None:
    """Route the ``connector`` loggers through vLLM's handlers (vLLM configures only ``vllm``)."""
    ours = logging.getLogger("disagg_router.connector")
    if ours.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def resolve_config(extra: dict[str, Any]) -> ConnectorConfig:
    """Extra config wins; else vLLM's NIXL side-channel env vars; else the defaults."""
    merged: dict[str, Any] = {}
    if os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST"):
        merged["side_channel_host"] = os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    if os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT"):
        merged["side_channel_port"] = os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    merged.update(extra)
    return ConnectorConfig.from_extra_config(merged)


def _tp_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def _tp_rank(vllm_config: Any) -> int:
    """This worker's tensor-parallel rank (vLLM's process group is up when a worker-side
    connector is created)."""
    if _tp_size(vllm_config) == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def _pp_rank(vllm_config: Any) -> int:
    """This worker's pipeline stage (vLLM ranks are ``pp_rank * tp_size + tp_rank``)."""
    if _pp_size(vllm_config) == 1:
        return 0
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group)


class DisaggPushConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Push-mode NIXL KV connector (D registers blocks, P WRITEs them). See the README."""

    _cache_hit_source = CacheHitSource.P2P  # D's pushed tokens come from another instance

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _attach_vllm_logging()
        ktc = vllm_config.kv_transfer_config
        refuse_unsupported(vllm_config, kv_cache_config)
        self._config = resolve_config(dict(ktc.kv_connector_extra_config or {}))
        engine_id = str(ktc.engine_id)
        self._scheduler: PushScheduler | None = None
        self._worker: PushWorker | None = None
        self._failed_blocks: set[int] = set()
        self._stats = PushTransferStats()
        if role == KVConnectorRole.SCHEDULER:
            from disagg_router.connector.scheduler import PushScheduler, engine_shape

            self._scheduler = PushScheduler(
                engine_id,
                self._config.side_channel_host,
                self._config.side_channel_port,
                vllm_config.cache_config.block_size,
                tp_size=_tp_size(vllm_config),
                shape=engine_shape(vllm_config),
            )
        else:
            from disagg_router.connector.worker import PushWorker, WorkerSetup

            setup = WorkerSetup(
                engine_id=engine_id,
                is_producer=bool(ktc.is_kv_producer),
                is_consumer=bool(ktc.is_kv_consumer),
                num_blocks=int(kv_cache_config.num_blocks),
                block_size=int(vllm_config.cache_config.block_size),
                kv_buffer_device=str(ktc.kv_buffer_device),
                kv_cache_layout=str(getattr(kv_cache_config, "kv_cache_layout", None) or ""),
                tp_rank=_tp_rank(vllm_config),
                tp_size=_tp_size(vllm_config),
                total_kv_heads=connector_kv_heads(vllm_config.model_config),
                pp_rank=_pp_rank(vllm_config),
                pp_size=_pp_size(vllm_config),
            )
            self._worker = PushWorker(setup, self._config)

    # ---- scheduler side ----------------------------------------------------------------------
    def _sched(self) -> PushScheduler:
        assert self._scheduler is not None, "scheduler hook called on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> PushConnectorMetadata:
        return self._sched().build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(
            connector_output.finished_sending, connector_output.finished_recving
        )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], list) else block_ids
        return self._sched().request_finished(request, list(ids))

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)

    # ---- worker side -------------------------------------------------------------------------
    def _work(self) -> PushWorker:
        assert self._worker is not None, "worker hook called on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bind this step's metadata and hand its decisions to the transfer core (non-blocking).

        vLLM binds a step's metadata before the step's forward pass, but calls ``start_load_kv``
        after it when the step loads nothing synchronously (vLLM 0.32 and 0.33): a finished
        prefill handed over there would wait for the whole next step, on a busy P another
        request's prefill, before P posts its WRITE.
        """
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, PushConnectorMetadata)
        self._work().start_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """No-op: the step's work was handed over when its metadata was bound."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: D's KV arrives before the request is scheduled (async load)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        """No-op: P's writer sends whole finished requests, not layers."""

    def wait_for_save(self) -> None:
        """No-op: WRITEs are asynchronous; P's blocks stay pinned until reported."""

    def _collect(self) -> WorkerStep:
        step = self._work().collect()
        self._stats.record_errors(step.errors)
        for rec in step.records:
            self._stats.record(rec)
            log = logger.info if rec.ok else logger.warning
            log(
                "transfer %s request %s side=%s ok=%s blocks=%d bytes=%d write_ms=%.2f "
                "reg_to_write_ms=%.2f %s",
                rec.transfer_key,
                rec.request_id,
                rec.side,
                rec.ok,
                rec.num_blocks,
                rec.num_bytes,
                rec.write_s * 1e3,
                rec.registration_to_write_s * 1e3,
                rec.reason,
            )
        return step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM <= 0.32 result API; failed loads are reported as invalid blocks."""
        step = self._collect()
        self._failed_blocks |= step.failed_block_ids
        return step.finished_sending or None, step.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str] | None = None) -> Any:
        """vLLM >= 0.32 result API (``finished_req_ids`` is optional: 0.33 drops it)."""
        step = self._collect()
        return KVConnectorTransferResults(
            finished_sending=step.finished_sending,
            finished_recving=step.finished_recving,
            failed_recving=step.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def get_kv_connector_stats(self) -> PushTransferStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, PushTransferStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PushTransferStats:
        return PushTransferStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> PushPromMetrics:
        return PushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: no. NIXL holds registrations of the KV memory that sleep would remap."""
        return False

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
