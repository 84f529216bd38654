"""Pipeline parallel P (pure layout math): which P workers a D rank waits on, and where a
pipeline stage's layers land in D's whole-model layout."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg_router.connector.layout import (
    HeadTransfer,
    LayoutSpec,
    RegionSpec,
    descriptor_ids,
    head_transfer,
    layer_index,
    rank_kv_heads,
    source_ranks,
    stage_regions,
)
from tests.unit.connector.test_tp_layout import HEAD

LAYERS = 12  # more than ten: ordered by layer name, one stage's layers are not one run


def by_name(layers: range) -> list[int]:
    """Layer indices in the order ``layout_from_kv_caches`` lists them (by layer name)."""
    return sorted(layers, key=lambda i: f"model.layers.{i}.self_attn.attn")


def model_layout(
    total: int, tp: int, rank: int, *, pp: int = 1, stage: int = 0, layers: int = LAYERS
) -> LayoutSpec:
    """A CPU-like (HND) layout of the layers stage ``stage`` of ``pp`` holds, TP rank ``rank``
    of ``tp`` (``total`` KV heads): one region per layer, each at its own address."""
    per = layers // pp
    held = by_name(range(stage * per, stage * per + per))
    heads = len(rank_kv_heads(total, tp, rank))
    block = heads * HEAD
    regions = tuple(RegionSpec((i + 1) * 1 << 20, block, block, 8) for i in held)
    return LayoutSpec(
        regions,
        dtype="bfloat16",
        block_size=16,
        block_format=(f"1:{heads}," if heads > 1 else "") + "2:16,3:8",
        head_bytes=HEAD,
        tp_rank=rank,
        tp_size=tp,
        total_kv_heads=total,
        pp_rank=stage,
        pp_size=pp,
        region_layers=tuple(held),
    )


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_rank", "ranks"),
    [
        (1, 1, 1, 0, (0,)),
        (1, 2, 1, 0, (0, 1)),  # P PP 2 -> D TP 1: both stages
        (2, 2, 1, 0, (0, 1, 2, 3)),  # P PP 2 x TP 2 -> D TP 1: every worker of P
        (2, 2, 2, 1, (1, 3)),  # P PP 2 x TP 2 -> D TP 2: TP rank 1 of each stage
        (1, 2, 2, 1, (0, 1)),  # P PP 2 -> D TP 2: both stages feed each D rank
        (4, 2, 1, 0, (0, 2, 4, 6)),  # replicas send nothing (2 heads on 4 ranks)
    ],
)
def test_d_waits_on_every_stage_of_p_at_vllms_ranks(
    p_tp: int, p_pp: int, d_tp: int, d_rank: int, ranks: tuple[int, ...]
) -> None:
    assert source_ranks(2, p_tp, p_pp, d_tp, d_rank) == ranks


def test_a_stage_finds_its_layers_in_ds_name_ordered_regions() -> None:
    d = model_layout(2, 1, 0)
    assert d.region_layers[:4] == (0, 1, 10, 11)
    for stage in (0, 1):
        p = model_layout(2, 1, 0, pp=2, stage=stage)
        picked = stage_regions(p, d)
        assert isinstance(picked, tuple)
        assert [d.region_layers[i] for i in picked] == list(p.region_layers)
        assert len(picked) == LAYERS // 2
    assert stage_regions(model_layout(2, 1, 0), d) == ()  # PP 1: the same positions


def test_a_stage_writes_its_regions_into_ds_regions_of_the_same_layers() -> None:
    d = model_layout(2, 1, 0)
    p = model_layout(2, 1, 0, pp=2, stage=1)
    t = head_transfer(p, d)
    assert isinstance(t, HeadTransfer) and t.d_ranks == frozenset({0})
    p_view, d_view = t.views(p, d)
    assert p_view == p
    want = {layer: r.addr for layer, r in zip(d.region_layers, d.regions, strict=True)}
    assert [r.addr for r in d_view.regions] == [want[layer] for layer in p.region_layers]
    # D's descriptor ids are over its view: one per block of each of the stage's regions.
    assert descriptor_ids(d_view, [3]) == [3 + 8 * i for i in range(LAYERS // 2)]


def test_pp2_tp2_to_d_tp1_narrows_to_the_head_and_to_the_stage() -> None:
    d = model_layout(2, 1, 0)
    for stage in (0, 1):
        for rank in (0, 1):
            p = model_layout(2, 2, rank, pp=2, stage=stage)
            t = head_transfer(p, d)
            assert isinstance(t, HeadTransfer)
            assert (t.p_offset, t.d_offset, t.length) == (0, rank * HEAD, HEAD)
            _, d_view = t.views(p, d)
            addrs = {layer: r.addr for layer, r in zip(d.region_layers, d.regions, strict=True)}
            assert [r.addr for r in d_view.regions] == [
                addrs[layer] + rank * HEAD for layer in p.region_layers
            ]


@pytest.mark.parametrize(
    ("d", "reason"),
    [
        (replace(model_layout(2, 1, 0), region_layers=()), "D states no layer index per KV"),
        (model_layout(2, 1, 0, layers=6), "layer 10 of P's pipeline stage 1 has no KV region"),
        (replace(model_layout(2, 1, 0), pp_size=2), "D has pipeline parallel size 2"),
        (replace(model_layout(2, 1, 0), block_size=32), "block size (tokens) differs: 32 vs 16"),
    ],
)
def test_a_stage_that_cannot_be_placed_is_refused_with_the_reason(
    d: LayoutSpec, reason: str
) -> None:
    why = head_transfer(model_layout(2, 1, 0, pp=2, stage=1), d)
    assert isinstance(why, str) and reason in why


def test_layout_json_carries_the_stage_and_its_layers() -> None:
    p = model_layout(2, 2, 1, pp=2, stage=1)
    raw = p.to_json()
    assert (raw["pp_rank"], raw["pp_size"], raw["region_layers"][:2]) == (1, 2, [10, 11])
    assert LayoutSpec.from_json(raw) == p and p.global_rank == 3
    old = {k: v for k, v in raw.items() if k not in ("pp_rank", "pp_size", "region_layers")}
    assert (LayoutSpec.from_json(old).pp_size, LayoutSpec.from_json(old).region_layers) == (1, ())


def test_layer_index_is_the_names_one_integer() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("l0") is None and layer_index("a.1.b.2") is None
