"""KV memory layout: which bytes of which memory hold each KV block, on P and on D.

All of the connector's layout code lives here (stdlib, and NumPy inside
:func:`descriptor_index` only; torch tensors are read through their attributes, never imported):

* :class:`RegionSpec` / :class:`LayoutSpec`: what a worker registers with NIXL and sends to its
  peer (part of wire protocol v1, see :mod:`disagg_router.connector.protocol`).
* :func:`layout_from_kv_caches` and :func:`kv_memory`: derive both from the KV cache tensors vLLM
  hands to ``register_kv_caches`` (CPU or CUDA), and :func:`check_buffer_device` against
  ``kv_buffer_device``.
* The block -> descriptor arithmetic P and D share. Descriptor order is region-major: descriptor
  ``offset(r) + b`` is physical block ``b`` of region ``r``, so a list of block ids maps to the
  same positions on both sides.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from disagg_router.connector.errors import LayoutError, ProtocolError, UnsupportedSetupError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

MemType = Literal["DRAM", "VRAM"]
"""NIXL memory types the connector registers: host memory, or CUDA device memory."""

Descriptor = tuple[int, int, int]
"""``(address, length, device id)`` as NIXL takes it."""

DescriptorIndex: TypeAlias = "npt.NDArray[np.int32]"
"""Positions in a prepared descriptor list (:func:`descriptor_index`), one per descriptor."""


@dataclass(frozen=True)
class RegionSpec:
    """One run of ``num_blocks`` equally sized chunks, ``block_stride`` bytes apart.

    A region is one layer's KV cache (or one K/V half, or one head, when the layout interleaves
    those with the block dimension); block ``b`` of it is ``block_bytes`` at
    ``addr + b * block_stride``.
    """

    addr: int
    block_stride: int
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class LayoutSpec:
    """The KV memory layout of one worker, as registered with NIXL and sent to the peer.

    ``dtype``, ``block_size`` and ``block_format`` are empty/0 when a peer did not state them
    (an older v1 peer); they are compared only when both sides state them.
    """

    regions: tuple[RegionSpec, ...]
    blocks_per_logical: int = 1
    """Physical (kernel) blocks per block of vLLM's block manager."""
    mem_type: MemType = "DRAM"
    device_id: int = 0
    """The CUDA device index for ``VRAM``; 0 for ``DRAM``."""
    dtype: str = ""
    """Element type of the KV cache, e.g. ``bfloat16``."""
    block_size: int = 0
    """Tokens per block of vLLM's block manager (``--block-size``)."""
    block_format: str = ""
    """The interior of one block of one region: ``dim:size`` in memory order, outermost first
    (``/split`` marks a dimension that makes separate regions). Equal on P and D when they use
    the same model and the same KV cache layout (``VLLM_KV_CACHE_LAYOUT``)."""
    head_bytes: int = 0
    """Bytes of one KV head inside a block of a region when this worker's heads are the
    outermost dimension inside a block (HND layouts, vLLM CPU): each head is then one contiguous
    chunk. 0 when they are not (NHD) or unknown: only whole blocks can be moved."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel size of this worker's instance."""
    total_kv_heads: int = 0
    """KV heads of the model (all ranks together); 0 when a peer did not state it (TP 1)."""
    pp_rank: int = 0
    """This worker's pipeline-parallel stage (P; D is always stage 0 of 1)."""
    pp_size: int = 1
    """Pipeline-parallel size of this worker's instance."""
    region_layers: tuple[int, ...] = ()
    """The model layer index of each region, in region order (empty when a peer did not state
    it). A pipeline stage holds only its own layers' regions; P finds them in D's by these."""

    @property
    def global_rank(self) -> int:
        """vLLM's rank of this worker (``pp_rank * tp_size + tp_rank``): a P worker's side
        channel listens on the base port + it and its notifications carry it as ``p_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def to_json(self) -> dict[str, Any]:
        """The ``d_layout`` object of a ``register`` message (v1 peers read only the first two
        keys and ignore the rest)."""
        return {
            "regions": [asdict(r) for r in self.regions],
            "blocks_per_logical": self.blocks_per_logical,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "block_format": self.block_format,
            "head_bytes": self.head_bytes,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads,
            "kv_heads": list(self.kv_heads()) if self.total_kv_heads else [],
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "region_layers": list(self.region_layers),
        }

    def kv_heads(self) -> tuple[int, int]:
        """``(first, end)`` of the KV heads this rank holds (:func:`rank_kv_heads`)."""
        heads = rank_kv_heads(self.total_kv_heads, self.tp_size, self.tp_rank)
        return heads.start, heads.stop

    @classmethod
    def from_json(cls, raw: Any) -> LayoutSpec:
        """Parse :meth:`to_json` output; raises :class:`ProtocolError` naming what is wrong.

        A peer without the tensor-parallel keys (``tp_rank``, ``tp_size``, ``total_kv_heads``,
        ``head_bytes``) is a TP 1 peer, one without ``pp_rank``/``pp_size`` a PP 1 peer. A stated
        ``kv_heads`` range must be the one its rank holds; stated ``region_layers`` name one
        layer per region."""
        layout = cls._from_json(raw)
        if layout.region_layers and len(layout.region_layers) != len(layout.regions):
            raise ProtocolError(
                f"bad layout: {len(layout.region_layers)} region_layers for "
                f"{len(layout.regions)} regions"
            )
        try:
            stated = tuple(int(h) for h in raw.get("kv_heads") or ())
            if layout.total_kv_heads and stated and stated != layout.kv_heads():
                raise ProtocolError(
                    f"bad layout: kv_heads {list(stated)} are not rank {layout.tp_rank} of "
                    f"{layout.tp_size}'s {list(layout.kv_heads())}"
                )
        except (TypeError, ValueError, LayoutError) as exc:
            raise ProtocolError(f"bad layout: {exc}") from exc
        return layout

    @classmethod
    def _from_json(cls, raw: Any) -> LayoutSpec:
        try:
            mem_type = raw.get("mem_type", "DRAM")
            if mem_type not in ("DRAM", "VRAM"):
                raise ProtocolError(f"bad layout: unknown mem_type {mem_type!r}")
            return cls(
                regions=tuple(RegionSpec(**r) for r in raw["regions"]),
                blocks_per_logical=int(raw["blocks_per_logical"]),
                mem_type=mem_type,
                device_id=int(raw.get("device_id", 0)),
                dtype=str(raw.get("dtype", "")),
                block_size=int(raw.get("block_size", 0)),
                block_format=str(raw.get("block_format", "")),
                head_bytes=int(raw.get("head_bytes", 0)),
                tp_rank=int(raw.get("tp_rank", 0)),
                tp_size=int(raw.get("tp_size", 1)),
                total_kv_heads=int(raw.get("total_kv_heads", 0)),
                pp_rank=int(raw.get("pp_rank", 0)),
                pp_size=int(raw.get("pp_size", 1)),
                region_layers=tuple(int(x) for x in raw.get("region_layers") or ()),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError(f"bad layout: {exc}") from exc

    def compatible_with(self, other: LayoutSpec) -> str | None:
        """``None`` if a block of ``self`` can be written into ``other``; else why not.

        Memory type, addresses, strides and block counts may differ; what a block *is* may not.
        """
        for what, mine, theirs in (
            ("dtype", self.dtype, other.dtype),
            ("block size (tokens)", self.block_size, other.block_size),
            ("block layout", self.block_format, other.block_format),
        ):
            if mine and theirs and mine != theirs:
                hint = " (use the same VLLM_KV_CACHE_LAYOUT)" if what == "block layout" else ""
                return f"{what} differs: {mine} vs {theirs}{hint}"
        if len(self.regions) != len(other.regions):
            return f"region count differs: {len(self.regions)} vs {len(other.regions)}"
        if self.blocks_per_logical != other.blocks_per_logical:
            return "physical blocks per logical block differ"
        for i, (a, b) in enumerate(zip(self.regions, other.regions, strict=True)):
            if a.block_bytes != b.block_bytes:
                return f"region {i} block bytes differ: {a.block_bytes} vs {b.block_bytes}"
        return None


# ---- tensor parallel: which KV heads go from which P rank to which D rank --------------------
def rank_kv_heads(total: int, tp_size: int, rank: int) -> range:
    """The KV heads (of ``total``) that TP rank ``rank`` of ``tp_size`` holds, as vLLM splits
    them: ``total / tp_size`` consecutive heads each, or, when ``total < tp_size``, one head
    replicated on ``tp_size / total`` consecutive ranks. ``total`` 0 (unknown) means TP 1 holds
    everything (``range(0, 0)``). Raises :class:`LayoutError` for sizes vLLM refuses too."""
    if not 0 <= rank < tp_size:
        raise LayoutError(f"tensor-parallel rank {rank} outside size {tp_size}")
    if total <= 0:
        return range(0, 0)
    if total >= tp_size:
        if total % tp_size:
            raise LayoutError(f"{total} KV heads do not divide over {tp_size} ranks")
        per = total // tp_size
        return range(rank * per, rank * per + per)
    if tp_size % total:
        raise LayoutError(f"{tp_size} ranks do not replicate {total} KV heads evenly")
    head = rank // (tp_size // total)
    return range(head, head + 1)


def is_source_rank(total: int, tp_size: int, rank: int) -> bool:
    """Whether P rank ``rank`` sends KV at all: of the ranks holding replicas of the same heads
    (``total < tp_size``) only the first sends; the others free their blocks at once."""
    return total <= 0 or total >= tp_size or rank % (tp_size // total) == 0


@dataclass(frozen=True)
class HeadCopy:
    """P rank ``p_rank`` supplies the KV heads ``heads`` (absolute indices) to one D rank."""

    p_rank: int
    heads: range


def head_sources(total: int, p_tp: int, d_tp: int, d_rank: int) -> tuple[HeadCopy, ...]:
    """Which P ranks D rank ``d_rank`` takes its heads from, in P rank order: every head from
    exactly one P rank (the first replica when P replicates heads). ``total`` 0: TP 1 peers."""
    if total <= 0:
        return (HeadCopy(0, range(0, 0)),)
    want = rank_kv_heads(total, d_tp, d_rank)
    out = []
    for p_rank in range(p_tp):
        if not is_source_rank(total, p_tp, p_rank):
            continue
        have = rank_kv_heads(total, p_tp, p_rank)
        lo, hi = max(want.start, have.start), min(want.stop, have.stop)
        if lo < hi:
            out.append(HeadCopy(p_rank, range(lo, hi)))
    return tuple(out)


def source_ranks(total: int, p_tp: int, p_pp: int, d_tp: int, d_rank: int) -> tuple[int, ...]:
    """The P workers (vLLM ranks ``stage * p_tp + tp_rank``) D rank ``d_rank`` registers with
    and waits on: in every pipeline stage of P, the TP ranks of :func:`head_sources`."""
    sources = head_sources(total, p_tp, d_tp, d_rank)
    return tuple(stage * p_tp + c.p_rank for stage in range(p_pp) for c in sources)


def served_d_ranks(total: int, p_tp: int, d_tp: int, p_rank: int) -> frozenset[int]:
    """The D ranks that take heads from P rank ``p_rank`` (each registers with it once)."""
    return frozenset(
        d
        for d in range(d_tp)
        if any(c.p_rank == p_rank for c in head_sources(total, p_tp, d_tp, d))
    )


@dataclass(frozen=True)
class HeadTransfer:
    """What one P rank writes into one D rank, inside every block of every region: ``length``
    bytes from ``p_offset`` in P's block to ``d_offset`` in D's (the whole block when both
    hold the same heads)."""

    p_offset: int
    d_offset: int
    length: int
    d_ranks: frozenset[int]
    """The D ranks this P rank serves for the same request (it keeps its blocks until each has
    had its WRITE, or its lease ran out)."""
    d_regions: tuple[int, ...] = ()
    """D's region for each of P's regions when P is one pipeline stage (its layers inside D's
    whole-model layout, :func:`stage_regions`); empty: the same positions (PP 1)."""

    def views(self, p: LayoutSpec, d: LayoutSpec) -> tuple[LayoutSpec, LayoutSpec]:
        """``(P's, D's)`` layouts narrowed to the bytes moved, D's also to the regions P writes
        (in P's region order). P's view keeps P's descriptor positions; D's prepared list is
        made over D's view, so D's descriptor ids are computed over it (:meth:`d_view`)."""
        return _narrow(p, self.p_offset, self.length), self.d_view(d)

    def d_view(self, d: LayoutSpec) -> LayoutSpec:
        """D's layout as this P rank writes it: its regions, the bytes moved of each block."""
        return _narrow(select_regions(d, self.d_regions), self.d_offset, self.length)


def _narrow(layout: LayoutSpec, offset: int, length: int) -> LayoutSpec:
    if offset == 0 and all(r.block_bytes == length for r in layout.regions):
        return layout
    regions = tuple(
        RegionSpec(r.addr + offset, r.block_stride, length, r.num_blocks) for r in layout.regions
    )
    return replace(layout, regions=regions)


def select_regions(layout: LayoutSpec, picked: Sequence[int]) -> LayoutSpec:
    """``layout`` with only the regions ``picked`` (in that order); all of them when empty."""
    if not picked:
        return layout
    layers = tuple(layout.region_layers[i] for i in picked) if layout.region_layers else ()
    return replace(layout, regions=tuple(layout.regions[i] for i in picked), region_layers=layers)


def stage_regions(p: LayoutSpec, d: LayoutSpec) -> tuple[int, ...] | str:
    """D's region for each region of P's pipeline stage, matched by layer index (and order
    within a layer), or why they cannot be matched. ``()`` for a PP 1 P: the same positions.

    Regions are ordered by layer *name* (``layout_from_kv_caches``), so a stage's layers are not
    one run of D's regions once a model has more than ten layers; matching by index is exact."""
    if p.pp_size == 1:
        return ()
    if d.pp_size != 1:
        return f"D has pipeline parallel size {d.pp_size}; D must have size 1"
    if not d.region_layers or len(p.region_layers) != len(p.regions):
        side = "D" if not d.region_layers else "P"
        return f"{side} states no layer index per KV region: P's pipeline stage cannot be placed"
    where: dict[int, list[int]] = {}
    for i, layer in enumerate(d.region_layers):
        where.setdefault(layer, []).append(i)
    out: list[int] = []
    used: dict[int, int] = {}
    for layer in p.region_layers:
        k = used[layer] = used.get(layer, 0) + 1
        slots = where.get(layer, [])
        if k > len(slots):
            return f"layer {layer} of P's pipeline stage {p.pp_rank} has no KV region on D"
        out.append(slots[k - 1])
    for layer, count in used.items():
        if count != len(where[layer]):
            return f"layer {layer} has {len(where[layer])} KV regions on D, {count} on P"
    return tuple(out)


def head_transfer(p: LayoutSpec, d: LayoutSpec) -> HeadTransfer | str:
    """How P rank ``p`` writes into D rank ``d`` (each layout states its rank), or why it
    cannot (the registration is then refused with that reason).

    A pipeline-parallel P rank writes its own layers' regions into D's regions of the same
    layers (:func:`stage_regions`); the checks below compare them with those of D's regions.
    Both hold the same heads: whole blocks, with :meth:`LayoutSpec.compatible_with`'s checks
    (any KV cache layout). Otherwise only a slice of heads moves, so both layouts must keep
    each head contiguous inside a block (``head_bytes``), with the same bytes per head.
    """
    picked = stage_regions(p, d)
    if isinstance(picked, str):
        return picked
    found = _tp_transfer(p, select_regions(d, picked))
    return found if isinstance(found, str) else replace(found, d_regions=picked)


def _tp_transfer(p: LayoutSpec, d: LayoutSpec) -> HeadTransfer | str:
    """:func:`head_transfer` between P's regions and the D regions they go to."""
    if p.tp_size > 1 and not d.total_kv_heads:
        return f"D states no KV head count (a TP 1-only peer) but P has tp_size={p.tp_size}"
    total = p.total_kv_heads if d.tp_size == 1 and not d.total_kv_heads else d.total_kv_heads
    if p.total_kv_heads and total != p.total_kv_heads:
        return f"KV head count differs: {total} vs {p.total_kv_heads}"
    try:
        copy = next(
            (
                c
                for c in head_sources(total, p.tp_size, d.tp_size, d.tp_rank)
                if c.p_rank == p.tp_rank
            ),
            None,
        )
        p_heads = rank_kv_heads(total, p.tp_size, p.tp_rank)
        d_heads = rank_kv_heads(total, d.tp_size, d.tp_rank)
    except LayoutError as exc:
        return str(exc)
    if copy is None:
        return f"D rank {d.tp_rank} of {d.tp_size} takes no KV heads from P rank {p.tp_rank}"
    served = served_d_ranks(total, p.tp_size, d.tp_size, p.tp_rank)
    if p_heads == d_heads:
        why = d.compatible_with(p)
        full = p.regions[0].block_bytes if p.regions else 0
        return why if why is not None else HeadTransfer(0, 0, full, served)
    return _slice_transfer(p, d, copy.heads, (p_heads.start, d_heads.start), served)


def _slice_transfer(
    p: LayoutSpec, d: LayoutSpec, heads: range, starts: tuple[int, int], served: frozenset[int]
) -> HeadTransfer | str:
    """The head slice P writes into D when they hold different heads (see :func:`head_transfer`)."""
    for side, layout in (("P", p), ("D", d)):
        if not layout.head_bytes:
            return (
                f"KV heads are not contiguous inside a block on {side} (block layout "
                f"{layout.block_format or '?'}): different tensor-parallel sizes need a KV cache "
                "layout with heads outermost in a block (HND, e.g. VLLM_KV_CACHE_LAYOUT=LBHNC)"
            )
    for what, mine, theirs in (
        ("dtype", d.dtype, p.dtype),
        ("block size (tokens)", d.block_size, p.block_size),
        ("bytes per KV head in a block", d.head_bytes, p.head_bytes),
        ("block layout of one head", _head_format(d), _head_format(p)),
        ("region count", len(d.regions), len(p.regions)),
        ("physical blocks per logical block", d.blocks_per_logical, p.blocks_per_logical),
    ):
        if mine != theirs:
            return f"{what} differs: {mine} vs {theirs}"
    hb = p.head_bytes
    first = heads.start
    return HeadTransfer((first - starts[0]) * hb, (first - starts[1]) * hb, len(heads) * hb, served)


def _head_format(layout: LayoutSpec) -> str:
    """``block_format`` without the heads dimension (``1:<heads>`` of vLLM's ``[B, H, N, C]``
    views; absent when a rank holds one head)."""
    return ",".join(p for p in layout.block_format.split(",") if not p.startswith("1:"))


# ---- descriptor arithmetic ------------------------------------------------------------------
def descriptors(layout: LayoutSpec) -> list[Descriptor]:
    """``(addr, length, device_id)`` for every physical block of every region, region-major."""
    dev = layout.device_id
    out: list[Descriptor] = []
    for region in layout.regions:
        out.extend(
            (region.addr + b * region.block_stride, region.block_bytes, dev)
            for b in range(region.num_blocks)
        )
    return out


def descriptor_index(layout: LayoutSpec, logical_ids: Sequence[int]) -> DescriptorIndex:
    """Descriptor indices (into :func:`descriptors`) for ``logical_ids`` in every region,
    region-major, as the int32 array NIXL's ``make_prepped_xfer`` takes without converting. Each
    logical block covers ``blocks_per_logical`` physical (kernel) blocks, in order.

    Who calls it: P's transfer core, for D's side when a registration arrives and for P's side
    when both halves of a transfer are known, ahead of the WRITE (vector arithmetic: 16,384
    positions cost microseconds here, and NIXL copies the array instead of converting a list
    element by element). NumPy comes with vLLM and NIXL; it is imported here, not when the
    package is, so the router never loads it.
    Raises ``ValueError`` for a block id outside the layout.
    """
    import numpy as np

    try:
        ids = np.asarray(logical_ids, dtype=np.int64)
    except OverflowError:
        raise ValueError("block id outside every region") from None
    if ids.size == 0:
        return np.zeros(0, dtype=np.int32)
    k = layout.blocks_per_logical
    # Bounds in Python ints, before any arithmetic that could wrap in int64.
    low, high = int(ids.min()) * k, int(ids.max()) * k + k - 1
    offsets = []
    offset = 0
    for region in layout.regions:
        if low < 0 or high >= region.num_blocks:
            bad = low if low < 0 else high
            raise ValueError(f"block {bad} outside region of {region.num_blocks} blocks")
        offsets.append(offset)
        offset += region.num_blocks
    phys = ids if k == 1 else (ids[:, None] * k + np.arange(k)).ravel()
    column = np.array(offsets, dtype=np.int64)[:, None]
    index: DescriptorIndex = (column + phys).astype(np.int32).ravel()
    return index


def descriptor_ids(layout: LayoutSpec, logical_ids: Sequence[int]) -> list[int]:
    """:func:`descriptor_index` as a list of ints (for readers and tests; the WRITE path keeps
    the array). Raises ``ValueError`` for a block id outside the layout."""
    ids: list[int] = descriptor_index(layout, logical_ids).tolist()
    return ids


def transfer_bytes(layout: LayoutSpec, num_logical_blocks: int) -> int:
    """Bytes moved when ``num_logical_blocks`` logical blocks are written."""
    per_physical = sum(r.block_bytes for r in layout.regions)
    return per_physical * num_logical_blocks * layout.blocks_per_logical


def memory_spans(layout: LayoutSpec) -> list[tuple[int, int]]:
    """``(addr, length)`` ranges to register with NIXL: every region's extent, overlapping
    extents merged (block-outermost layouts interleave all layers in one range). Touching but
    disjoint extents stay separate: they may be different allocations."""
    extents = sorted(
        (r.addr, r.addr + (r.num_blocks - 1) * r.block_stride + r.block_bytes)
        for r in layout.regions
        if r.num_blocks > 0
    )
    merged: list[list[int]] = []
    for start, end in extents:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


# ---- KV cache tensors -> layout -------------------------------------------------------------
def kv_memory(tensors: Iterable[torch.Tensor]) -> tuple[MemType, int]:
    """NIXL memory type and device id of the KV cache: ``VRAM`` and the CUDA index of the
    tensors' device, or ``DRAM`` and 0. All tensors must live on one device."""
    devices = {(t.device.type, t.device.index) for t in tensors}
    if not devices:
        raise LayoutError("no KV cache tensors to register")
    if len(devices) > 1:
        raise LayoutError(f"KV cache tensors span several devices: {sorted(map(str, devices))}")
    kind, index = devices.pop()
    if kind == "cuda":
        return "VRAM", int(index or 0)
    if kind == "cpu":
        return "DRAM", 0
    raise LayoutError(f"KV cache on {kind!r} memory is not supported (cpu or cuda)")


def check_buffer_device(mem_type: MemType, kv_buffer_device: str) -> None:
    """Refuse a ``kv_buffer_device`` that disagrees with where the KV cache is.

    ``cuda`` needs a CUDA KV cache (registered as VRAM), ``cpu`` a host one (DRAM). A CUDA
    cache with ``kv_buffer_device: cpu`` asks for a host staging buffer, which this connector
    does not provide: it is refused rather than silently registering the GPU cache.
    """
    want = (kv_buffer_device or "").lower()
    if mem_type == "VRAM" and want == "cpu":
        raise UnsupportedSetupError(
            "kv_buffer_device is 'cpu' but the KV cache is on the GPU: this connector moves "
            "GPU KV caches directly (VRAM) and has no host staging buffer; set "
            "kv_buffer_device to 'cuda'"
        )
    if (mem_type, want) not in (("VRAM", "cuda"), ("DRAM", "cpu")):
        where = "GPU (cuda)" if mem_type == "VRAM" else "host (cpu)"
        raise UnsupportedSetupError(
            f"kv_buffer_device is {kv_buffer_device!r} but the KV cache is in {where} memory; "
            f"set kv_buffer_device to '{'cuda' if mem_type == 'VRAM' else 'cpu'}'"
        )


def layout_from_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_size: int = 0
) -> LayoutSpec:
    """Describe per-layer KV cache tensors as regions of equally sized blocks.

    Works from each tensor's shape and strides, for any of vLLM's KV cache layouts: the block
    dimension is dim 0 (vLLM's ``[B, H, N, C]`` views, FlashInfer-style ``[B, 2, ...]``) or
    dim 1 after a small outer dimension (``[2, B, ...]``). Dimensions that are dense inside a
    block form its bytes; any other (K/V halves, heads interleaved with blocks or layers) splits
    the tensor into one region per index. Layers are ordered by name and a tensor bound to
    several layer names is registered once, so P and D (same model) agree on region order.
    """
    mem_type, device_id = kv_memory(kv_caches.values())
    regions: list[RegionSpec] = []
    per_logical: set[int] = set()
    formats: set[str] = set()
    dtypes: set[str] = set()
    heads: set[int] = set()
    layers: list[int | None] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name in sorted(kv_caches):
        t = kv_caches[name]
        ident = (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        found, k, fmt, head_bytes = _tensor_regions(name, t, num_blocks)
        regions += found
        layers += [layer_index(name)] * len(found)
        per_logical.add(k)
        formats.add(fmt)
        heads.add(head_bytes)
        dtypes.add(str(t.dtype).removeprefix("torch."))
    if len(per_logical) > 1:
        raise LayoutError("layers disagree on physical blocks per logical block")
    if len(formats) > 1 or len(dtypes) > 1:
        raise LayoutError(f"layers disagree on block layout or dtype: {formats} {dtypes}")
    return LayoutSpec(
        regions=tuple(regions),
        blocks_per_logical=max(per_logical, default=1),
        mem_type=mem_type,
        device_id=device_id,
        dtype=dtypes.pop() if dtypes else "",
        block_size=block_size,
        block_format=formats.pop() if formats else "",
        head_bytes=heads.pop() if len(heads) == 1 else 0,
        region_layers=tuple(i for i in layers if i is not None) if None not in layers else (),
    )


def layer_index(name: str) -> int | None:
    """The model layer of a KV cache tensor's layer name (``model.layers.12.self_attn.attn``
    -> 12): its one integer component, like vLLM's ``extract_layer_index``; ``None`` when
    there is not exactly one."""
    found = [int(part) for part in name.split(".") if part.isdigit()]
    return found[0] if len(found) == 1 else None


def _block_dim(name: str, shape: tuple[int, ...], num_blocks: int) -> int:
    dim = 0 if shape[0] % num_blocks == 0 and shape[0] >= num_blocks else 1
    if len(shape) <= dim + 1 or shape[dim] % num_blocks:
        raise LayoutError(f"{name}: cannot find a block dimension in shape {shape}")
    return dim


def _tensor_regions(
    name: str, t: torch.Tensor, num_blocks: int
) -> tuple[list[RegionSpec], int, str, int]:
    """One tensor's regions, physical blocks per logical block, block format and bytes per
    head in a block (:func:`_head_bytes`)."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    bdim = _block_dim(name, shape, num_blocks)
    inner = sorted(
        (d for d in range(len(shape)) if d != bdim and shape[d] > 1), key=strides.__getitem__
    )
    dense: list[int] = []
    split: list[int] = []
    chunk = 1  # elements of one block of one region
    for d in inner:
        if not split and strides[d] == chunk and strides[d] < strides[bdim]:
            dense.append(d)
            chunk *= shape[d]
        else:
            split.append(d)
    extent = chunk
    for d in sorted((d for d in [*split, bdim] if shape[d] > 1), key=strides.__getitem__):
        if strides[d] < extent:
            raise LayoutError(
                f"{name}: blocks overlap in memory (shape {shape}, strides {strides})"
            )
        extent += (shape[d] - 1) * strides[d]
    elem = t.element_size()
    base = int(t.data_ptr())
    split.sort()
    regions = [
        RegionSpec(
            addr=base + sum(i * strides[d] for i, d in zip(idx, split, strict=True)) * elem,
            block_stride=strides[bdim] * elem,
            block_bytes=chunk * elem,
            num_blocks=shape[bdim],
        )
        for idx in itertools.product(*(range(shape[d]) for d in split))
    ]
    order = sorted(
        (d for d in range(len(shape)) if d != bdim and shape[d] > 1), key=lambda d: -strides[d]
    )
    fmt = ",".join(f"{d}:{shape[d]}{'/split' if d in split else ''}" for d in order)
    return regions, shape[bdim] // num_blocks, fmt, _head_bytes(shape, bdim, dense, chunk * elem)


def _head_bytes(shape: tuple[int, ...], bdim: int, dense: list[int], block_bytes: int) -> int:
    """Bytes of one KV head in a block when heads are contiguous chunks of it (vLLM's
    ``[B, H, N, C]`` views with H outermost among the dense dimensions, or one head), else 0."""
    if len(shape) != 4 or bdim != 0:
        return 0
    heads = shape[1]
    if heads == 1:
        return block_bytes
    return block_bytes // heads if dense and dense[-1] == 1 else 0
