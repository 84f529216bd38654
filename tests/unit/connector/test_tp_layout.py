"""Tensor-parallel head mapping (pure layout math): which P rank's heads land where in D's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg_router.connector.layout import (
    HeadCopy,
    HeadTransfer,
    LayoutSpec,
    RegionSpec,
    head_sources,
    head_transfer,
    is_source_rank,
    layout_from_kv_caches,
    rank_kv_heads,
    served_d_ranks,
)

HEAD = 256  # bytes of one KV head in a block


def rank_layout(total: int, tp: int, rank: int, *, head_bytes: int = HEAD) -> LayoutSpec:
    """A CPU-like (HND) layout of 2 layers for rank ``rank`` of ``tp`` (``total`` KV heads)."""
    heads = len(rank_kv_heads(total, tp, rank))
    fmt = (f"1:{heads}," if heads > 1 else "") + "2:16,3:8"
    block = heads * HEAD
    regions = tuple(RegionSpec(1000 * (i + 1) * 1024, block, block, 8) for i in range(2))
    return LayoutSpec(
        regions,
        dtype="bfloat16",
        block_size=16,
        block_format=fmt,
        head_bytes=head_bytes,
        tp_rank=rank,
        tp_size=tp,
        total_kv_heads=total,
    )


def test_rank_heads_split_and_replicate_like_vllm() -> None:
    assert [rank_kv_heads(4, 2, r) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    # Fewer heads than ranks: vLLM's num_kv_head_replicas = tp / heads consecutive ranks.
    assert [rank_kv_heads(2, 4, r) for r in range(4)] == [range(h, h + 1) for h in (0, 0, 1, 1)]
    assert [is_source_rank(2, 4, r) for r in range(4)] == [True, False, True, False]
    assert rank_kv_heads(0, 1, 0) == range(0, 0)  # a peer that states no head count


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "d_rank", "sources"),
    [
        (1, 1, 0, [HeadCopy(0, range(0, 2))]),
        (2, 1, 0, [HeadCopy(0, range(0, 1)), HeadCopy(1, range(1, 2))]),  # P TP2 -> D TP1
        (1, 2, 1, [HeadCopy(0, range(1, 2))]),  # P TP1 -> D TP2
        (2, 2, 1, [HeadCopy(1, range(1, 2))]),  # P TP2 -> D TP2: rank to rank
        (4, 1, 0, [HeadCopy(0, range(0, 1)), HeadCopy(2, range(1, 2))]),  # P replicates
        (1, 4, 3, [HeadCopy(0, range(1, 2))]),  # D replicates
    ],
)
def test_every_d_head_comes_from_exactly_one_p_rank(
    p_tp: int, d_tp: int, d_rank: int, sources: list[HeadCopy]
) -> None:
    assert list(head_sources(2, p_tp, d_tp, d_rank)) == sources


def test_served_d_ranks_are_who_will_register() -> None:
    assert served_d_ranks(2, 1, 2, 0) == {0, 1}
    assert served_d_ranks(2, 2, 1, 1) == {0}
    assert served_d_ranks(2, 4, 1, 1) == frozenset()  # a replica: never a source


def test_p_tp2_to_d_tp1_lands_each_p_head_at_its_offset() -> None:
    d = rank_layout(2, 1, 0)
    for p_rank in (0, 1):
        t = head_transfer(rank_layout(2, 2, p_rank), d)
        assert t == HeadTransfer(0, p_rank * HEAD, HEAD, frozenset({0}))


def test_p_tp1_to_d_tp2_sends_each_d_rank_its_head() -> None:
    p = rank_layout(2, 1, 0)
    for d_rank in (0, 1):
        t = head_transfer(p, rank_layout(2, 2, d_rank))
        assert t == HeadTransfer(d_rank * HEAD, 0, HEAD, frozenset({0, 1}))
        assert isinstance(t, HeadTransfer)
        p_view, d_view = t.views(p, rank_layout(2, 2, d_rank))
        assert p_view.regions[0].addr == p.regions[0].addr + d_rank * HEAD
        assert [r.block_bytes for r in p_view.regions + d_view.regions] == [HEAD] * 4


def test_equal_tp_moves_whole_blocks_in_any_layout() -> None:
    # Heads not contiguous in a block (NHD): equal TP still works rank to rank.
    p, d = rank_layout(4, 2, 1, head_bytes=0), rank_layout(4, 2, 1, head_bytes=0)
    t = head_transfer(p, d)
    assert t == HeadTransfer(0, 0, 2 * HEAD, frozenset({1}))
    assert isinstance(t, HeadTransfer) and t.views(p, d) == (p, d)


@pytest.mark.parametrize(
    ("p", "d", "reason"),
    [
        (
            rank_layout(2, 1, 0, head_bytes=0),
            rank_layout(2, 2, 0),
            "KV heads are not contiguous inside a block on P",
        ),
        (
            rank_layout(2, 2, 1),
            rank_layout(2, 2, 0),
            "D rank 0 of 2 takes no KV heads from P rank 1",
        ),
        (rank_layout(2, 2, 0), rank_layout(4, 2, 0), "KV head count differs: 4 vs 2"),
        (rank_layout(2, 2, 0), replace(rank_layout(2, 1, 0), total_kv_heads=0), "TP 1-only peer"),
        (
            rank_layout(2, 2, 0),
            replace(rank_layout(2, 1, 0), block_size=32),
            "block size (tokens) differs: 32 vs 16",
        ),
    ],
)
def test_impossible_pairs_are_refused_with_a_reason(
    p: LayoutSpec, d: LayoutSpec, reason: str
) -> None:
    why = head_transfer(p, d)
    assert isinstance(why, str) and reason in why


def test_layout_json_carries_the_rank_and_its_heads() -> None:
    d = rank_layout(2, 2, 1)
    raw = d.to_json()
    assert (raw["tp_rank"], raw["tp_size"], raw["kv_heads"]) == (1, 2, [1, 2])
    assert LayoutSpec.from_json(raw) == d
    old = {k: v for k, v in raw.items() if k not in ("tp_rank", "tp_size", "total_kv_heads")}
    assert LayoutSpec.from_json(old).tp_size == 1  # a peer without the keys is TP 1


def test_head_bytes_from_cpu_and_nhd_tensors() -> None:
    torch = pytest.importorskip("torch")
    hnd = torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)  # vLLM CPU: [B, H, N, 2*D]
    assert layout_from_kv_caches({"l0": hnd}, 8).head_bytes == 16 * 64 * 2
    one = torch.zeros(8, 1, 16, 64, dtype=torch.bfloat16)
    assert layout_from_kv_caches({"l0": one}, 8).head_bytes == 16 * 64 * 2
    nhd = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    assert layout_from_kv_caches({"l0": nhd}, 8).head_bytes == 0


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_an_mla_cache_is_one_head_that_p_rank_0_alone_sends(p_tp: int, d_tp: int) -> None:
    """MLA: every rank holds the one latent "head" (total 1); P rank 0 serves every D rank with
    whole blocks, P's other ranks are replicas that serve none."""
    for d_rank in range(d_tp):
        assert head_sources(1, p_tp, d_tp, d_rank) == (HeadCopy(0, range(0, 1)),)
        d = rank_layout(1, d_tp, d_rank)
        assert head_transfer(rank_layout(1, p_tp, 0), d) == HeadTransfer(
            0, 0, HEAD, frozenset(range(d_tp))
        )
        for p_rank in range(1, p_tp):
            why = head_transfer(rank_layout(1, p_tp, p_rank), d)
            assert isinstance(why, str) and "takes no KV heads from P rank" in why
    assert served_d_ranks(1, p_tp, d_tp, 0) == frozenset(range(d_tp))
    assert all(not served_d_ranks(1, p_tp, d_tp, r) for r in range(1, p_tp))
