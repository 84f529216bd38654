"""KV memory layout: which bytes hold each KV block, on P and on D (stdlib only).

All of the connector's layout code lives here:

* :class:`RegionSpec` / :class:`LayoutSpec`: what a worker registers with NIXL and sends to its
  peer (part of wire protocol v1, see :mod:`connector.protocol`).
* :func:`layout_from_kv_caches`: derive it from the KV cache tensors vLLM hands to
  ``register_kv_caches`` (torch tensors are read through their attributes, never imported).
* The block -> descriptor arithmetic P and D share. Descriptor order is region-major: descriptor
  ``offset(r) + b`` is physical block ``b`` of region ``r``, so a list of block ids maps to the
  same positions on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from connector.errors import LayoutError, ProtocolError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RegionSpec:
    """One registered memory region holding ``num_blocks`` equally sized KV blocks."""

    addr: int
    block_stride: int
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class LayoutSpec:
    """The KV memory layout of one worker; P and D must agree on region count and block bytes."""

    regions: tuple[RegionSpec, ...]
    blocks_per_logical: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "regions": [asdict(r) for r in self.regions],
            "blocks_per_logical": self.blocks_per_logical,
        }

    @classmethod
    def from_json(cls, raw: Any) -> LayoutSpec:
        try:
            regions = tuple(RegionSpec(**r) for r in raw["regions"])
            return cls(regions=regions, blocks_per_logical=int(raw["blocks_per_logical"]))
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"bad layout: {exc}") from exc

    def compatible_with(self, other: LayoutSpec) -> str | None:
        """``None`` if a block of ``self`` can be written into ``other``; else why not."""
        if len(self.regions) != len(other.regions):
            return f"region count differs: {len(self.regions)} vs {len(other.regions)}"
        if self.blocks_per_logical != other.blocks_per_logical:
            return "physical blocks per logical block differ"
        for i, (a, b) in enumerate(zip(self.regions, other.regions, strict=True)):
            if a.block_bytes != b.block_bytes:
                return f"region {i} block bytes differ: {a.block_bytes} vs {b.block_bytes}"
        return None


def descriptors(layout: LayoutSpec) -> list[tuple[int, int, int]]:
    """``(addr, length, device_id)`` for every physical block of every region, region-major."""
    out: list[tuple[int, int, int]] = []
    for region in layout.regions:
        out.extend(
            (region.addr + b * region.block_stride, region.block_bytes, 0)
            for b in range(region.num_blocks)
        )
    return out


def physical_blocks(layout: LayoutSpec, logical_ids: Sequence[int]) -> list[int]:
    """Expand logical block ids to the physical (kernel) block ids they cover, in order."""
    k = layout.blocks_per_logical
    return [b * k + i for b in logical_ids for i in range(k)]


def descriptor_ids(layout: LayoutSpec, logical_ids: Sequence[int]) -> list[int]:
    """Descriptor indices (into :func:`descriptors`) for ``logical_ids`` in every region.

    Raises ``ValueError`` for a block id outside the layout.
    """
    phys = physical_blocks(layout, logical_ids)
    out: list[int] = []
    offset = 0
    for region in layout.regions:
        for b in phys:
            if not 0 <= b < region.num_blocks:
                raise ValueError(f"block {b} outside region of {region.num_blocks} blocks")
            out.append(offset + b)
        offset += region.num_blocks
    return out


def transfer_bytes(layout: LayoutSpec, num_logical_blocks: int) -> int:
    """Bytes moved when ``num_logical_blocks`` logical blocks are written."""
    per_physical = sum(r.block_bytes for r in layout.regions)
    return per_physical * num_logical_blocks * layout.blocks_per_logical


def layout_from_kv_caches(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> LayoutSpec:
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
