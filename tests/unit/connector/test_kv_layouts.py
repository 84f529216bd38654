"""Every KV cache layout the connector claims, built on CPU and checked byte for byte.

The vLLM layouts are built with vLLM's own shape functions (``compute_layout_strides`` and
``create_kv_cache_views``, which every CUDA attention backend's cache goes through in vLLM
0.32/0.33), one per ``KVCacheLayout``; the older per-backend shapes (FlashAttention
``[2, B, N, H, D]``, FlashInfer ``[B, 2, N, H, D]``, their HND variants) are built by hand. For each
the test checks that the descriptors of a block cover exactly that block's bytes in every layer,
and that copying descriptor by descriptor (what a NIXL WRITE does) from a P cache into a D cache,
in the same or another compatible layout, makes D's blocks equal P's and leaves the rest alone.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from disagg_router.connector.errors import LayoutError, UnsupportedSetupError
from disagg_router.connector.layout import (
    HeadTransfer,
    LayoutSpec,
    check_buffer_device,
    descriptor_ids,
    descriptors,
    head_transfer,
    is_source_rank,
    kv_memory,
    layout_from_kv_caches,
    memory_spans,
)
from disagg_router.connector.setup_checks import connector_kv_heads

NUM_BLOCKS = 10
LAYERS = 3
Caches = dict[str, torch.Tensor]


def vllm_caches(
    layout_name: str, kernel_block_size: int | None = None, mla: bool = False, heads: int = 4
) -> Caches:
    """One model's KV cache as vLLM 0.32/0.33 allocates it on any device (here: CPU), with
    ``heads`` KV heads (one tensor-parallel rank's); with ``mla`` one latent tensor per layer
    (DeepSeek's 512 + 64 wide, as vLLM's CPU MLA keeps it)."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = (
        interface.MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        )
        if mla
        else interface.FullAttentionSpec(
            block_size=16, num_kv_heads=heads, head_size=8, dtype=torch.bfloat16
        )
    )
    layer_stride, block_stride, *_ = interface.compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout
    )
    size = spec.page_size_bytes * NUM_BLOCKS * LAYERS
    tensor = interface.KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = interface.create_kv_cache_views(
        raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size
    )
    return dict(zip(tensor.layers, views, strict=True))


def legacy_caches(block_dim: int, hnd: bool) -> Caches:
    """Per-layer ``[2, B, N, H, D]`` (``block_dim`` 1) or ``[B, 2, N, H, D]`` (0), with N and H
    swapped in memory for HND; all layers in one allocation, as vLLM allocates them."""
    outer = (2, NUM_BLOCKS) if block_dim == 1 else (NUM_BLOCKS, 2)
    inner = (4, 16, 8) if hnd else (16, 4, 8)
    big = torch.zeros((LAYERS, *outer, *inner), dtype=torch.float16)
    return {f"layers.{i}": big[i].permute(0, 1, 3, 2, 4) if hnd else big[i] for i in range(LAYERS)}


def blocks_of(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Physical blocks ``[first, first + count)`` of a cache tensor (block dim 1 after K/V)."""
    return t.narrow(1 if t.shape[0] == 2 else 0, first, count)


VLLM_LAYOUTS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"]
BUILDERS: dict[str, Callable[[], Caches]] = {
    **{f"vllm-{name}": functools.partial(vllm_caches, name) for name in VLLM_LAYOUTS},
    "vllm-LBNHC-kernel-blocks": lambda: vllm_caches("LBNHC", kernel_block_size=8),
    "vllm-mla-LBNHC": lambda: vllm_caches("LBNHC", mla=True),
    "flash_attn-NHD": lambda: legacy_caches(block_dim=1, hnd=False),
    "flash_attn-HND": lambda: legacy_caches(block_dim=1, hnd=True),
    "flashinfer-NHD": lambda: legacy_caches(block_dim=0, hnd=False),
    "flashinfer-HND": lambda: legacy_caches(block_dim=0, hnd=True),
}
REGIONS_PER_LAYER = {"vllm-LHBNC": 4, "vllm-BHLNC": 4, "flash_attn-NHD": 2, "flash_attn-HND": 2}


def storage_bytes(t: torch.Tensor) -> tuple[int, Any]:
    """(base address, writable uint8 view) of the whole allocation behind ``t``."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    return storage.data_ptr(), flat.numpy()


def block_bytes_of(caches: Caches, block: int, layout: LayoutSpec) -> tuple[set[int], int]:
    """(byte offsets of ``block`` in every layer, bytes its descriptors cover) in one storage."""
    first = next(iter(caches.values()))
    base, mem = storage_bytes(first)
    mem[:] = 0
    k = layout.blocks_per_logical
    for t in caches.values():
        blocks_of(t, block * k, k).view(torch.uint8).fill_(0xA5)
    marked = set(mem.nonzero()[0].tolist())
    descs = descriptors(layout)
    covered = 0
    for i in descriptor_ids(layout, [block]):
        addr, length, _ = descs[i]
        span = set(range(addr - base, addr - base + length))
        assert span <= marked, "a descriptor covers bytes outside the block"
        covered += length
    return marked, covered


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_descriptors_cover_exactly_each_block(kind: str) -> None:
    caches = BUILDERS[kind]()
    layout = layout_from_kv_caches(caches, NUM_BLOCKS, block_size=16)
    assert len(layout.regions) == LAYERS * REGIONS_PER_LAYER.get(kind, 1)
    assert layout.mem_type == "DRAM" and layout.device_id == 0
    assert layout.blocks_per_logical == (2 if "kernel" in kind else 1)
    for block in (0, 4, NUM_BLOCKS - 1):
        marked, covered = block_bytes_of(caches, block, layout)
        assert covered == len(marked)  # disjoint descriptors, every byte of the block


def simulated_write(
    p: Caches, p_layout: LayoutSpec, d_layout: LayoutSpec, p_blocks: list[int], d_blocks: list[int]
) -> None:
    """What P's WRITE does: copy local descriptor i into remote descriptor i."""
    src, dst = descriptors(p_layout), descriptors(d_layout)
    local, remote = descriptor_ids(p_layout, p_blocks), descriptor_ids(d_layout, d_blocks)
    assert len(local) == len(remote)
    for li, ri in zip(local, remote, strict=True):
        assert src[li][1] == dst[ri][1]
        ctypes.memmove(dst[ri][0], src[li][0], src[li][1])


PAIRS = [(name, name) for name in sorted(BUILDERS)] + [
    ("vllm-LBNHC", "vllm-BLNHC"),  # layer-compact P, block-outermost D: same block format
    ("vllm-BLHNC", "vllm-LBHNC"),
    ("vllm-LHBNC", "vllm-BHLNC"),
]


@pytest.mark.parametrize(("p_kind", "d_kind"), PAIRS)
def test_write_moves_p_blocks_into_d_blocks_byte_for_byte(p_kind: str, d_kind: str) -> None:
    torch.manual_seed(0)
    p, d = BUILDERS[p_kind](), BUILDERS[d_kind]()
    for t in p.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    p_layout = layout_from_kv_caches(p, NUM_BLOCKS, block_size=16)
    d_layout = layout_from_kv_caches(d, NUM_BLOCKS, block_size=16)
    assert d_layout.compatible_with(p_layout) is None
    p_blocks, d_blocks = [3, 1, 7], [0, 9, 5]
    simulated_write(p, p_layout, d_layout, p_blocks, d_blocks)
    k = p_layout.blocks_per_logical
    for name in p:
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert torch.equal(blocks_of(d[name], db * k, k), blocks_of(p[name], pb * k, k))
        for b in range(NUM_BLOCKS * k):
            if b // k not in d_blocks:
                assert not blocks_of(d[name], b, 1).any()


def test_layouts_with_another_block_interior_are_refused_with_the_reason() -> None:
    nhd = layout_from_kv_caches(vllm_caches("LBNHC"), NUM_BLOCKS, block_size=16)
    hnd = layout_from_kv_caches(vllm_caches("LBHNC"), NUM_BLOCKS, block_size=16)
    assert "block layout differs" in str(nhd.compatible_with(hnd))
    assert "VLLM_KV_CACHE_LAYOUT" in str(nhd.compatible_with(hnd))
    split = layout_from_kv_caches(vllm_caches("LHBNC"), NUM_BLOCKS, block_size=16)
    assert nhd.compatible_with(split) is not None
    other_size = layout_from_kv_caches(vllm_caches("LBNHC"), NUM_BLOCKS, block_size=32)
    assert "block size (tokens) differs: 16 vs 32" in str(nhd.compatible_with(other_size))
    half = {n: t.to(torch.float16) for n, t in vllm_caches("LBNHC").items()}
    fp16 = layout_from_kv_caches(half, NUM_BLOCKS, block_size=16)
    assert "dtype differs: bfloat16 vs float16" in str(nhd.compatible_with(fp16))


def test_block_outermost_layers_are_registered_as_one_span() -> None:
    packed = layout_from_kv_caches(vllm_caches("BLNHC"), NUM_BLOCKS)
    assert len(memory_spans(packed)) == 1
    compact = layout_from_kv_caches(vllm_caches("LBNHC"), NUM_BLOCKS)
    spans = memory_spans(compact)
    assert len(spans) == LAYERS  # adjacent layers stay separate registrations
    assert sum(length for _, length in spans) == sum(
        r.num_blocks * r.block_bytes for r in compact.regions
    )


def test_a_layer_bound_twice_is_registered_once() -> None:
    caches = vllm_caches("LBNHC")
    caches["model.layers.9.attn"] = caches["model.layers.0.attn"]  # KV sharing across layers
    assert len(layout_from_kv_caches(caches, NUM_BLOCKS).regions) == LAYERS


class OnDevice:
    """A CPU tensor that reports another device (CUDA tensors cannot exist on this machine);
    the layout code reads only these attributes."""

    def __init__(self, t: torch.Tensor, device: str) -> None:
        self._t = t
        self.device = torch.device(device)
        self.shape, self.dtype = t.shape, t.dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def test_cuda_caches_are_vram_on_their_device_and_descriptors_carry_it() -> None:
    caches: Any = {n: OnDevice(t, "cuda:3") for n, t in vllm_caches("LBNHC").items()}
    assert kv_memory(caches.values()) == ("VRAM", 3)
    layout = layout_from_kv_caches(caches, NUM_BLOCKS, block_size=16)
    assert (layout.mem_type, layout.device_id) == ("VRAM", 3)
    assert {dev for _, _, dev in descriptors(layout)} == {3}
    assert LayoutSpec.from_json(layout.to_json()) == layout


def test_memory_type_comes_from_the_tensors() -> None:
    cpu = vllm_caches("LBNHC")
    assert kv_memory(cpu.values()) == ("DRAM", 0)
    mixed: Any = [next(iter(cpu.values())), OnDevice(next(iter(cpu.values())), "cuda:0")]
    with pytest.raises(LayoutError, match="several devices"):
        kv_memory(mixed)
    with pytest.raises(LayoutError, match="not supported"):
        kv_memory([OnDevice(next(iter(cpu.values())), "meta")])


@pytest.mark.parametrize(
    ("mem_type", "buffer_device", "refusal"),
    [
        ("VRAM", "cuda", None),
        ("DRAM", "cpu", None),
        ("VRAM", "cpu", "no host staging buffer"),
        ("DRAM", "cuda", "KV cache is in host (cpu) memory"),
        ("VRAM", "xpu", "set kv_buffer_device to 'cuda'"),
    ],
)
def test_kv_buffer_device_must_agree_with_the_cache(
    mem_type: Any, buffer_device: str, refusal: str | None
) -> None:
    if refusal is None:
        check_buffer_device(mem_type, buffer_device)
        return
    with pytest.raises(UnsupportedSetupError, match=re.escape(refusal)):
        check_buffer_device(mem_type, buffer_device)


def test_layers_with_different_block_interiors_are_refused() -> None:
    """One KV cache group whose layers differ in page size (e.g. per-layer head sizes) is not
    one layout: the worker refuses it when vLLM registers the caches, i.e. at start-up."""
    caches = {
        "layers.0": torch.zeros((NUM_BLOCKS, 2, 16, 8), dtype=torch.bfloat16),
        "layers.1": torch.zeros((NUM_BLOCKS, 2, 16, 16), dtype=torch.bfloat16),
    }
    with pytest.raises(LayoutError, match="layers disagree on block layout"):
        layout_from_kv_caches(caches, NUM_BLOCKS)


def rank_caches(layout_name: str, tp: int, rank: int) -> tuple[Caches, LayoutSpec]:
    """One TP rank's cache of a 4-KV-head model, filled with random values, and its layout."""
    caches = vllm_caches(layout_name, heads=4 // tp)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    layout = layout_from_kv_caches(caches, NUM_BLOCKS, block_size=16)
    return caches, replace(layout, tp_rank=rank, tp_size=tp, total_kv_heads=4)


def tp_write(p: tuple[Caches, LayoutSpec], d: tuple[Caches, LayoutSpec]) -> None:
    """P rank ``p`` WRITEs its share of blocks 3, 1 into D's blocks 0, 9 (head-slice views)."""
    transfer = head_transfer(p[1], d[1])
    assert isinstance(transfer, HeadTransfer), transfer
    p_view, d_view = transfer.views(p[1], d[1])
    simulated_write(p[0], p_view, d_view, [3, 1], [0, 9])


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_tp_write_lands_every_head_at_its_place(layout_name: str, p_tp: int, d_tp: int) -> None:
    """Heads outermost in a block (HND; vLLM CPU's ``[B, H, N, 2*D]`` is one): any TP pair."""
    torch.manual_seed(0)
    ps = [rank_caches(layout_name, p_tp, r) for r in range(p_tp)]
    ds = [rank_caches(layout_name, d_tp, r) for r in range(d_tp)]
    for d in ds:
        for t in d[0].values():
            t.zero_()
        for p in ps:  # the P ranks this D rank takes heads from (the others refuse it)
            if isinstance(head_transfer(p[1], d[1]), HeadTransfer):
                tp_write(p, d)
    per_p, per_d = 4 // p_tp, 4 // d_tp
    for d_rank, (d_caches, _) in enumerate(ds):
        for name, d_view in d_caches.items():  # [B, H, N, C] views
            for local in range(per_d):
                head = d_rank * per_d + local
                p_caches = ps[head // per_p][0]
                want = p_caches[name][[3, 1], head % per_p]
                assert torch.equal(d_view[[0, 9], local], want), (d_rank, head)
            untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 9)]
            assert not d_view[untouched].any()


def test_different_tp_with_heads_inside_a_block_is_refused_with_the_reason() -> None:
    _, p = rank_caches("LBNHC", 1, 0)
    _, d = rank_caches("LBNHC", 2, 0)
    why = head_transfer(p, d)
    assert isinstance(why, str) and "not contiguous inside a block on P" in why
    _, p2 = rank_caches("LBNHC", 2, 0)
    assert isinstance(head_transfer(p2, d), HeadTransfer)  # equal TP: whole blocks


MLA_MODEL = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 16)
"""A DeepSeek-V2-like model config as the facade reads it (16 attention KV heads, MLA)."""


def mla_rank(tp: int, rank: int) -> tuple[Caches, LayoutSpec]:
    """One TP rank's latent cache (vLLM's MLA views, 576 wide) with values of its own, and its
    layout with the KV head count the facade states for an MLA model."""
    caches = vllm_caches("LBNHC", mla=True)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    layout = layout_from_kv_caches(caches, NUM_BLOCKS, block_size=16)
    heads = connector_kv_heads(MLA_MODEL)
    return caches, replace(layout, tp_rank=rank, tp_size=tp, total_kv_heads=heads)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_mla_latent_cache_goes_from_p_rank_0_alone_into_every_d_rank(p_tp: int, d_tp: int) -> None:
    """Every TP rank holds the whole latent cache: P rank 0 writes whole blocks into every D
    rank, byte for byte, and P's other ranks (replicas, here with different bytes) write none."""
    torch.manual_seed(0)
    ps = [mla_rank(p_tp, r) for r in range(p_tp)]
    ds = [mla_rank(d_tp, r) for r in range(d_tp)]
    assert [is_source_rank(1, p_tp, r) for r in range(p_tp)] == [True] + [False] * (p_tp - 1)
    for d_caches, d in ds:
        for t in d_caches.values():
            t.zero_()
        writers = [p.tp_rank for _, p in ps if isinstance(head_transfer(p, d), HeadTransfer)]
        assert writers == [0]
        assert head_transfer(ps[0][1], d) == HeadTransfer(
            0, 0, d.regions[0].block_bytes, frozenset(range(d_tp))
        )
        tp_write(ps[0], (d_caches, d))
        for name, d_view in d_caches.items():
            want = ps[0][0][name][[3, 1]].view(torch.uint8)
            assert torch.equal(d_view[[0, 9]].view(torch.uint8), want)
            assert not d_view[[b for b in range(NUM_BLOCKS) if b not in (0, 9)]].any()


def stage_caches(
    layers: range, heads: int, tp: int, rank: int, pp: int, stage: int
) -> tuple[Caches, LayoutSpec]:
    """The caches of the layers ``layers`` (vLLM CPU's ``[B, H, N, 2*D]`` per layer, named like
    vLLM's attention layers) of one worker, random values, and its layout."""
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, heads, 16, 8).to(torch.bfloat16)
        for i in layers
    }
    layout = layout_from_kv_caches(caches, NUM_BLOCKS, block_size=16)
    layout = replace(layout, tp_rank=rank, tp_size=tp, total_kv_heads=4)
    return caches, replace(layout, pp_rank=stage, pp_size=pp)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (2, 2)])
def test_pp_write_lands_each_stages_layers_in_ds_same_layers(p_tp: int, d_tp: int) -> None:
    """P PP 2 (x TP ``p_tp``), 12 layers -> D PP 1: every stage's layers and heads land in D's
    same layer and heads, byte for byte (ordered by name, layers 10 and 11 sit between 1 and 2)."""
    torch.manual_seed(0)
    stages = [range(0, 6), range(6, 12)]
    ps = [stage_caches(stages[s], 4 // p_tp, p_tp, r, 2, s) for s in range(2) for r in range(p_tp)]
    for d_rank in range(d_tp):
        d_caches, d = stage_caches(range(12), 4 // d_tp, d_tp, d_rank, 1, 0)
        for t in d_caches.values():
            t.zero_()
        for p_caches, p in ps:  # vLLM rank order: stage * p_tp + tp_rank
            transfer = head_transfer(p, d)
            if isinstance(transfer, HeadTransfer):
                p_view, d_view = transfer.views(p, d)
                simulated_write(p_caches, p_view, d_view, [3, 1], [0, 9])
        per_p, per_d = 4 // p_tp, 4 // d_tp
        for layer in range(12):
            name = f"model.layers.{layer}.self_attn.attn"
            for local in range(per_d):
                head = d_rank * per_d + local
                p_caches = ps[(layer // 6) * p_tp + head // per_p][0]
                want = p_caches[name][[3, 1], head % per_p]
                assert torch.equal(d_caches[name][[0, 9], local], want), (layer, head)
            untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 9)]
            assert not d_caches[name][untouched].any()
