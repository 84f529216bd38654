"""Block-to-descriptor arithmetic over a :class:`~connector.protocol.LayoutSpec` (pure Python).

Descriptor order is region-major: descriptor ``r * num_blocks_r_prefix + b`` is physical block
``b`` of region ``r``. P and D build their descriptor lists with the same function, so a list of
block ids maps to the same positions on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

from connector.protocol import LayoutSpec


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
