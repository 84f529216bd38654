"""Descriptor arithmetic, KV-tensor layout discovery and config parsing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagg_router.connector.config import ConnectorConfig
from disagg_router.connector.errors import ConfigError, LayoutError
from disagg_router.connector.facade import resolve_config
from disagg_router.connector.layout import (
    LayoutSpec,
    RegionSpec,
    descriptor_ids,
    descriptor_index,
    descriptors,
    layout_from_kv_caches,
    transfer_bytes,
)


def test_descriptors_are_region_major_and_ids_match_blocks() -> None:
    layout = LayoutSpec(regions=(RegionSpec(1000, 100, 64, 4), RegionSpec(5000, 100, 64, 4)))
    descs = descriptors(layout)
    assert descs[0] == (1000, 64, 0) and descs[3] == (1300, 64, 0) and descs[4] == (5000, 64, 0)
    ids = descriptor_ids(layout, [3, 1])
    assert [descs[i][0] for i in ids] == [1300, 1100, 5300, 5100]
    assert transfer_bytes(layout, 2) == 2 * 2 * 64
    with pytest.raises(ValueError, match="outside region"):
        descriptor_ids(layout, [4])


def test_descriptor_index_is_the_int32_array_nixl_takes() -> None:
    layout = LayoutSpec(
        regions=(RegionSpec(0, 64, 64, 8), RegionSpec(4096, 64, 64, 8)), blocks_per_logical=2
    )
    index = descriptor_index(layout, [3, 0])
    assert index.dtype.name == "int32"
    assert index.tolist() == [6, 7, 0, 1, 14, 15, 8, 9] == descriptor_ids(layout, [3, 0])
    assert descriptor_index(layout, []).tolist() == []
    with pytest.raises(ValueError, match="block 9 outside region of 8 blocks"):
        descriptor_index(layout, [4])
    with pytest.raises(ValueError, match="block -2 outside region"):
        descriptor_index(layout, [0, -1])
    with pytest.raises(ValueError, match="outside every region"):  # past int64: no wrap-around
        descriptor_index(layout, [2**70])


def test_physical_blocks_per_logical_expand_in_order() -> None:
    layout = LayoutSpec(regions=(RegionSpec(0, 10, 10, 8),), blocks_per_logical=2)
    assert descriptor_index(layout, [3, 0]).tolist() == [6, 7, 0, 1]


def test_layout_from_cpu_kv_cache_shape() -> None:
    # CPU attention: [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer.
    caches = {f"layer.{i}": torch.zeros(6, 2, 128, 64, dtype=torch.bfloat16) for i in (1, 0)}
    layout = layout_from_kv_caches(caches, num_blocks=6)
    assert len(layout.regions) == 2
    assert layout.regions[0].addr == caches["layer.0"].data_ptr()  # ordered by layer name
    assert layout.regions[0].block_bytes == 2 * 128 * 64 * 2
    assert layout.regions[0].block_stride == layout.regions[0].block_bytes
    assert layout.blocks_per_logical == 1


def test_layout_from_kv_first_shape_and_kernel_blocks() -> None:
    t = torch.zeros(2, 8, 16, 4, 8)  # [K/V, physical blocks, block, heads, head]
    layout = layout_from_kv_caches({"l": t}, num_blocks=4)
    assert len(layout.regions) == 2 and layout.blocks_per_logical == 2
    assert layout.regions[1].addr - layout.regions[0].addr == 8 * 16 * 4 * 8 * 4


def test_layout_rejects_blocks_it_cannot_describe() -> None:
    # A permuted block interior (HND vs NHD) is still one contiguous run per block: accepted.
    t = torch.zeros(6, 8, 4).transpose(1, 2)
    assert layout_from_kv_caches({"l": t}, num_blocks=6).regions[0].block_bytes == 8 * 4 * 4
    # Blocks that overlap in memory cannot be written independently: refused.
    overlapping = torch.zeros(64).as_strided((6, 8), (4, 1))
    with pytest.raises(LayoutError, match="overlap"):
        layout_from_kv_caches({"l": overlapping}, num_blocks=6)


def test_config_parses_and_names_bad_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ConnectorConfig.from_extra_config({"transfer_timeout_s": "2.5", "other": 1})
    assert cfg.transfer_timeout_s == 2.5 and cfg.lease_s == 30.0
    with pytest.raises(ConfigError, match="transfer_timeout_s"):
        ConnectorConfig.from_extra_config({"transfer_timeout_s": -1})
    with pytest.raises(ConfigError, match="side_channel_port"):
        ConnectorConfig.from_extra_config({"side_channel_port": "abc"})
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "18299")
    assert resolve_config({}).side_channel_port == 18299
    assert resolve_config({"side_channel_port": 7}).side_channel_port == 7


@pytest.mark.parametrize(
    ("raw", "want"), [(True, True), (False, False), ("true", True), ("FALSE", False), (1, True)]
)
def test_progress_thread_flag_parses(raw: object, want: bool) -> None:
    assert (
        ConnectorConfig.from_extra_config({"nixl_progress_thread": raw}).nixl_progress_thread
        is want
    )


def test_progress_thread_flag_is_off_by_default_and_rejects_junk() -> None:
    assert ConnectorConfig().nixl_progress_thread is False
    with pytest.raises(ConfigError, match="nixl_progress_thread"):
        ConnectorConfig.from_extra_config({"nixl_progress_thread": "maybe"})


def test_poll_cadences_parse_and_reject_non_positive() -> None:
    cfg = ConnectorConfig.from_extra_config({"writer_poll_s": "0.001", "receiver_poll_s": 0.004})
    assert (cfg.writer_poll_s, cfg.receiver_poll_s) == (0.001, 0.004)
    assert ConnectorConfig().receiver_poll_s < 0.002  # D learns of a WRITE within ~0.5 ms
    with pytest.raises(ConfigError, match="receiver_poll_s"):
        ConnectorConfig.from_extra_config({"receiver_poll_s": 0})


def test_every_setting_says_which_side_reads_it() -> None:
    names = [f.name for f in dataclasses.fields(ConnectorConfig)]
    assert {ConnectorConfig.read_by(n) for n in names} == {"P", "D", "both"}
    assert ConnectorConfig.read_by("side_channel_host") == "P"
    assert ConnectorConfig.read_by("receiver_poll_s") == "D"
