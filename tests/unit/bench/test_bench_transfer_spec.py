"""Transfer benchmark shape arithmetic and P TP shares (no NIXL)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.transfer import run_transfer
from bench.transfer_spec import TransferSpec, bare_positions, key_suffix
from bench.transfer_tp import (
    bare_remote_descs,
    connector_remote_descs,
    connector_share,
    d_layout,
    fill_value,
    p_layout,
    shares_landed,
)


def test_bytes_and_descriptors_per_write() -> None:
    spec = TransferSpec(regions=4, blocks_per_region=512, block_bytes=2048, blocks_per_write=256)
    assert spec.bytes_per_write == 4 * 256 * 2048
    assert spec.descs_per_write == 1024
    spec.validate()


@pytest.mark.parametrize(
    "kwargs", [{"blocks_per_write": 0}, {"blocks_per_write": 513}, {"iterations": 0}]
)
def test_bad_spec_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TransferSpec(**kwargs).validate()


@pytest.mark.parametrize("kwargs", [{"p_tp": 0}, {"p_tp": 3, "block_bytes": 2048}])
def test_bad_tp_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="p_tp"):
        TransferSpec(**kwargs).validate()


def test_tp_share_and_key_names() -> None:
    assert TransferSpec(block_bytes=2048, p_tp=4).share_bytes == 512
    assert TransferSpec(block_bytes=2048).share_bytes == 2048
    assert key_suffix(1) == ""  # P TP 1 keeps today's keys
    assert key_suffix(2) == "_p_tp2"


def test_tp_runs_only_the_endpoint_kinds() -> None:
    """Refused before any process starts (no NIXL needed)."""
    with pytest.raises(ValueError, match="p_tp > 1 runs the kinds"):
        run_transfer(TransferSpec(p_tp=2), ("bare", "connector-path"))


TP_SPEC = TransferSpec(regions=3, blocks_per_region=8, block_bytes=4096, blocks_per_write=5)
D_ADDR = 1 << 20


def _written_once(spec: TransferSpec, ranges: list[tuple[int, int]]) -> None:
    """Each byte of the first ``blocks_per_write`` blocks of every region of D's buffer at
    ``D_ADDR`` is in exactly one range; nothing else is."""
    region = spec.blocks_per_region * spec.block_bytes
    want = [
        (D_ADDR + r * region + b * spec.block_bytes, spec.block_bytes)
        for r in range(spec.regions)
        for b in range(spec.blocks_per_write)
    ]
    merged: list[tuple[int, int]] = []
    for addr, length in sorted(ranges):
        assert not merged or addr >= merged[-1][0] + merged[-1][1], "a byte is written twice"
        if merged and addr == merged[-1][0] + merged[-1][1] and (addr - D_ADDR) % spec.block_bytes:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((addr, length))
    assert merged == want


@pytest.mark.parametrize("p_tp", [1, 2, 4])
def test_connector_shares_cover_d_blocks_once(p_tp: int) -> None:
    spec = replace(TP_SPEC, p_tp=p_tp)
    share = spec.block_bytes // p_tp
    ranges = []
    for rank in range(p_tp):
        descs = connector_remote_descs(spec, rank, D_ADDR)
        assert len(descs) == spec.descs_per_write
        # Rank r's heads sit at r * share inside every one of D's blocks.
        assert {(addr - D_ADDR) % spec.block_bytes for addr, _, _ in descs} == {rank * share}
        assert {length for _, length, _ in descs} == {share}
        ranges += [(addr, length) for addr, length, _ in descs]
    _written_once(spec, ranges)


@pytest.mark.parametrize("p_tp", [1, 2, 4])
def test_bare_shares_match_the_connector(p_tp: int) -> None:
    spec = replace(TP_SPEC, p_tp=p_tp)
    for rank in range(p_tp):
        every = bare_remote_descs(spec, rank, D_ADDR)
        posted = [every[i] for i in bare_positions(spec).tolist()]
        assert posted == connector_remote_descs(spec, rank, D_ADDR)


def test_connector_refusal_surfaces() -> None:
    """A rank whose heads the connector will not map is an error, not a silent whole block."""
    spec = replace(TP_SPEC, p_tp=2)
    p = p_layout(spec, 1, 0)
    d = replace(d_layout(spec, D_ADDR), head_bytes=0)
    with pytest.raises(ValueError, match="refuses P rank 1: KV heads are not contiguous"):
        connector_share(p, d)


def test_shares_landed_checks_every_share() -> None:
    spec = replace(TP_SPEC, p_tp=2)
    share = spec.share_bytes
    buf = np.zeros((spec.regions, spec.blocks_per_region, spec.block_bytes), dtype=np.uint8)
    for rank in range(2):
        buf[:, : spec.blocks_per_write, rank * share : (rank + 1) * share] = fill_value(rank)
    assert shares_landed(spec, buf.ravel())
    swapped = buf.copy()
    swapped[1, 2, :share] = fill_value(1)
    assert not shares_landed(spec, swapped.ravel())
    stray = buf.copy()
    stray[0, spec.blocks_per_write, 0] = 1
    assert not shares_landed(spec, stray.ravel())
    missing = buf.copy()
    missing[2, 0, share:] = 0
    assert not shares_landed(spec, missing.ravel())
