"""The device check's KV caches: vLLM's default layout, a pattern that tells blocks apart."""

from __future__ import annotations

from bench.device_kv import CacheShape, KVCache
from disagg_router.connector.layout import layout_from_kv_caches

SHAPE = CacheShape(layers=2, heads=4, block_size=16, content=32, num_blocks=8)


def test_views_are_vllm_per_layer_caches_in_nhd_order() -> None:
    cache = KVCache(SHAPE, "cpu")
    view = cache.views["model.layers.1.self_attn.attn"]
    assert tuple(view.shape) == (8, 4, 16, 32)  # [B, H, N, C]
    layout = layout_from_kv_caches(cache.views, SHAPE.num_blocks, block_size=16)
    assert len(layout.regions) == 2 and layout.regions[0].block_bytes == SHAPE.page_bytes
    assert SHAPE.block_bytes == 2 * 4 * 16 * 32 * 2


def test_pattern_checks_tell_which_block_landed_where() -> None:
    p, d = KVCache(SHAPE, "cpu"), KVCache(SHAPE, "cpu")
    p.fill_pattern()
    assert d.zero_except(set())
    d.bytes[:, 5] = p.bytes[:, 3]
    assert d.holds([5], [3])
    assert not d.holds([5], [4])  # another P block's bytes differ
    assert d.zero_except({5}) and not d.zero_except(set())
    d.bytes[1, 5, 7] ^= 1  # one flipped byte in one layer
    assert not d.holds([5], [3])
