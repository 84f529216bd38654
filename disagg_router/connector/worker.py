"""Worker side of the connector (runs in vLLM's worker, next to the KV cache tensors).

Who calls it: the facade, from vLLM's worker hooks. It describes the KV cache tensors as a
:class:`~disagg_router.connector.layout.LayoutSpec` (memory type and device from the tensors,
checked against ``kv_buffer_device``), owns the NIXL endpoint and the transfer core
(:class:`PushProducer` on P, :class:`PushConsumer` on D) and forwards each step's metadata to them.
It never blocks the engine thread on the network. :meth:`PushWorker.collect` raises
:class:`~disagg_router.connector.errors.TransferCoreFailedError` once a transfer-core thread has
stopped, so that vLLM fails the engine (see :mod:`disagg_router.connector.supervision`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from disagg_router.connector import faults
from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.consumer import PushConsumer
from disagg_router.connector.layout import check_buffer_device, kv_memory, layout_from_kv_caches
from disagg_router.connector.metadata import PushConnectorMetadata
from disagg_router.connector.nixl_backend import NixlEndpoint
from disagg_router.connector.producer import PushProducer
from disagg_router.connector.records import TransferRecord
from disagg_router.connector.supervision import CoreHealth

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSetup:
    """What the worker needs to know about its vLLM instance."""

    engine_id: str
    is_producer: bool
    is_consumer: bool
    num_blocks: int
    """Blocks of vLLM's block manager (``kv_cache_config.num_blocks``)."""
    block_size: int
    """Tokens per block (``cache_config.block_size``)."""
    kv_buffer_device: str
    """``kv_transfer_config.kv_buffer_device``: must say where the KV cache is."""
    kv_cache_layout: str = ""
    """vLLM's resolved KV cache layout name (e.g. ``LBNHC``), for the logs."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    tp_size: int = 1
    total_kv_heads: int = 0
    """The model's KV heads, all ranks together (0: unknown, TP 1 only)."""
    pp_rank: int = 0
    """This worker's pipeline stage (P only: start-up refuses PP > 1 on D)."""
    pp_size: int = 1


@dataclass
class WorkerStep:
    """What the worker hands back to vLLM for one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    records: list[TransferRecord] = field(default_factory=list)
    errors: int = 0
    """Errors the transfer core's threads met since the last step
    (:mod:`disagg_router.connector.supervision`)."""


class PushWorker:
    """Per-worker transfer state; see the module docstring."""

    def __init__(self, setup: WorkerSetup, config: ConnectorConfig) -> None:
        self.setup = setup
        self.config = config
        self.endpoint: NixlEndpoint | None = None
        self.producer: PushProducer | None = None
        self.consumer: PushConsumer | None = None
        self.health = CoreHealth()
        self._recv_blocks: dict[str, tuple[int, ...]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV memory with NIXL and start the transfer core (once).

        Raises :class:`~disagg_router.connector.errors.UnsupportedSetupError` when
        ``kv_buffer_device`` disagrees with where the tensors are,
        :class:`~disagg_router.connector.errors.LayoutError` when they cannot be described as
        blocks.
        """
        s = self.setup
        mem_type, device_id = kv_memory(kv_caches.values())
        check_buffer_device(mem_type, s.kv_buffer_device)
        layout = replace(
            layout_from_kv_caches(kv_caches, s.num_blocks, block_size=s.block_size),
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
            total_kv_heads=s.total_kv_heads,
            pp_rank=s.pp_rank,
            pp_size=s.pp_size,
        )
        rank = layout.global_rank  # P: its side channel listens on the base port + it
        name = f"dpc-{s.engine_id}-r{rank}-{uuid.uuid4().hex[:8]}"
        self.endpoint = NixlEndpoint(name, layout, progress_thread=self.config.nixl_progress_thread)
        if s.is_producer:
            self.producer = PushProducer(
                faults.wrap(self.endpoint, self.config),
                s.engine_id,
                self._rank_config(rank),
                health=self.health,
            )
            logger.info(
                "P side channel of rank %d (PP stage %d, TP rank %d) on %s:%d",
                rank,
                s.pp_rank,
                s.tp_rank,
                self.config.side_channel_host,
                self.producer.port,
            )
        if s.is_consumer:
            self.consumer = PushConsumer(self.endpoint, self.config, health=self.health)
        logger.info(
            "NIXL agent %s: %s device %d, %d regions x %d blocks, %s %d-token blocks, "
            "vLLM layout %s, block format %s, KV heads %s of %d (%d bytes each in a block)",
            name,
            mem_type,
            device_id,
            len(layout.regions),
            layout.regions[0].num_blocks if layout.regions else 0,
            layout.dtype,
            layout.block_size,
            s.kv_cache_layout or "?",
            layout.block_format,
            list(layout.kv_heads()) if layout.total_kv_heads else "?",
            layout.total_kv_heads,
            layout.head_bytes,
        )

    def _rank_config(self, rank: int) -> ConnectorConfig:
        """P: each worker's side channel listens on the base port + its vLLM ``rank`` (0: any
        port)."""
        port = self.config.side_channel_port
        if not port:
            return self.config
        return replace(self.config, side_channel_port=port + rank)

    def start_step(self, meta: PushConnectorMetadata) -> None:
        """Hand this step's decisions to the transfer core (non-blocking)."""
        if self.consumer is not None:
            for spec in meta.registrations:
                self._recv_blocks[spec.d_request_id] = spec.block_ids
                self.consumer.register(spec)
            for rid in meta.cancels:
                self.consumer.cancel(rid)
            for cancel in meta.key_cancels:
                self.consumer.cancel_key(cancel)
        if self.producer is not None:
            for fin in meta.finished_prefills:
                self.producer.add_finished(fin)
            for abort in meta.failed_prefills:
                self.producer.abort(abort)

    def collect(self) -> WorkerStep:
        """Completions since the last call (each request id reported once).

        Raises :class:`~disagg_router.connector.errors.TransferCoreFailedError` once a transfer-core
        thread has stopped (vLLM then fails the engine: the instance reports itself unhealthy)."""
        self.health.check()
        step = WorkerStep(errors=self.health.take_errors())
        if self.producer is not None:
            step.finished_sending = self.producer.take_released()
            step.records += self.producer.take_records()
        if self.consumer is not None:
            step.finished_recving, step.failed_recving = self.consumer.take_results()
            step.records += self.consumer.take_records()
            for rid in step.finished_recving:
                blocks = self._recv_blocks.pop(rid, ())
                if rid in step.failed_recving:
                    step.failed_block_ids.update(blocks)
        return step

    def shutdown(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
