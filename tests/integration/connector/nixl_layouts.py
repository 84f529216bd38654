"""Shared helper: two numpy 'layers' of equally sized blocks and their LayoutSpec."""

from __future__ import annotations

import numpy as np

from disagg_router.connector.layout import LayoutSpec, RegionSpec

NUM_REGIONS = 2


def make_regions(num_blocks: int, block_floats: int) -> tuple[list[np.ndarray], LayoutSpec]:
    arrays = [np.zeros((num_blocks, block_floats), dtype=np.float32) for _ in range(NUM_REGIONS)]
    regions = tuple(
        RegionSpec(
            addr=int(a.ctypes.data),
            block_stride=block_floats * 4,
            block_bytes=block_floats * 4,
            num_blocks=num_blocks,
        )
        for a in arrays
    )
    return arrays, LayoutSpec(regions=regions)
