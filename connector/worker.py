"""Worker side of the connector (runs in vLLM's worker, next to the KV cache tensors).

Who calls it: the facade, from vLLM's worker hooks. It turns the KV cache tensors into a
:class:`~connector.protocol.LayoutSpec`, owns the NIXL endpoint and the transfer core
(:class:`PushProducer` on P, :class:`PushConsumer` on D) and forwards each step's metadata to
them. It never blocks the engine thread on the network.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass, field

import torch

from connector.config import ConnectorConfig
from connector.consumer import PushConsumer
from connector.metadata import PushConnectorMetadata
from connector.nixl_backend import NixlEndpoint
from connector.producer import PushProducer
from connector.protocol import LayoutSpec, RegionSpec
from connector.records import TransferRecord

logger = logging.getLogger(__name__)


class LayoutError(ValueError):
    """The KV cache tensors have a layout the connector cannot describe as blocks."""


def layout_from_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> LayoutSpec:
    """Describe per-layer KV tensors as regions of equally sized, contiguous blocks.

    The block dimension is dim 0 (CPU: ``[blocks, heads, block_size, 2*head]``) or dim 1 with a
    small outer dim (``[2, blocks, ...]``: one region per outer index). Layers are ordered by
    name so P and D (same model) produce the same region order.
    """
    regions: list[RegionSpec] = []
    per_logical = 0
    for name in sorted(kv_caches):
        t = kv_caches[name]
        dim = 0 if t.shape[0] % num_blocks == 0 and t.shape[0] >= num_blocks else 1
        if t.dim() <= dim + 1 or t.shape[dim] % num_blocks:
            raise LayoutError(f"{name}: cannot find a block dimension in shape {tuple(t.shape)}")
        tail = t.shape[dim + 1 :]
        expected = 1
        for size, stride in zip(reversed(tail), reversed(t.stride()[dim + 1 :]), strict=True):
            if stride != expected:
                raise LayoutError(f"{name}: block interior is not contiguous")
            expected *= size
        elem = t.element_size()
        k = t.shape[dim] // num_blocks
        if per_logical and k != per_logical:
            raise LayoutError("layers disagree on physical blocks per logical block")
        per_logical = k
        outer = 1 if dim == 0 else t.shape[0]
        for o in range(outer):
            base = t.data_ptr() + (o * t.stride(0) * elem if dim == 1 else 0)
            regions.append(
                RegionSpec(
                    addr=base,
                    block_stride=t.stride(dim) * elem,
                    block_bytes=math.prod(tail) * elem,
                    num_blocks=t.shape[dim],
                )
            )
    return LayoutSpec(regions=tuple(regions), blocks_per_logical=max(per_logical, 1))


@dataclass
class WorkerStep:
    """What the worker hands back to vLLM for one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_block_ids: set[int] = field(default_factory=set)
    records: list[TransferRecord] = field(default_factory=list)


class PushWorker:
    """Per-worker transfer state; see the module docstring."""

    def __init__(
        self,
        engine_id: str,
        config: ConnectorConfig,
        is_producer: bool,
        is_consumer: bool,
        num_blocks: int,
    ) -> None:
        self.engine_id = engine_id
        self.config = config
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.num_blocks = num_blocks
        self.endpoint: NixlEndpoint | None = None
        self.producer: PushProducer | None = None
        self.consumer: PushConsumer | None = None
        self._recv_blocks: dict[str, tuple[int, ...]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV memory with NIXL and start the transfer core (once)."""
        layout = layout_from_kv_caches(kv_caches, self.num_blocks)
        name = f"dpc-{self.engine_id}-{uuid.uuid4().hex[:8]}"
        self.endpoint = NixlEndpoint(name, layout, progress_thread=self.config.nixl_progress_thread)
        if self.is_producer:
            self.producer = PushProducer(self.endpoint, self.engine_id, self.config)
            logger.info(
                "P side channel on %s:%d", self.config.side_channel_host, self.producer.port
            )
        if self.is_consumer:
            self.consumer = PushConsumer(self.endpoint, self.config)
        logger.info(
            "NIXL agent %s: %d regions x %d blocks",
            name,
            len(layout.regions),
            layout.regions[0].num_blocks if layout.regions else 0,
        )

    def start_step(self, meta: PushConnectorMetadata) -> None:
        """Hand this step's decisions to the transfer core (non-blocking)."""
        if self.consumer is not None:
            for reg in meta.registrations:
                self._recv_blocks[reg.d_request_id] = reg.block_ids
                self.consumer.register(
                    reg.d_request_id,
                    reg.transfer_key,
                    reg.p_engine_id,
                    reg.host,
                    reg.port,
                    reg.block_ids,
                    reg.first_block,
                )
            for rid in meta.cancels:
                self.consumer.cancel(rid)
            for kc in meta.key_cancels:
                self.consumer.cancel_key(kc.transfer_key, kc.host, kc.port)
        if self.producer is not None:
            for fin in meta.finished_prefills:
                self.producer.add_finished(fin.transfer_key, fin.p_request_id, fin.block_ids)
            for ab in meta.failed_prefills:
                self.producer.abort(ab.transfer_key, ab.reason)

    def collect(self) -> WorkerStep:
        """Completions since the last call (each request id reported once)."""
        step = WorkerStep()
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
