"""Which instance holds which KV cache blocks, from vLLM's KV events; longest cached prefix.

Who calls it: each instance's event stream (:mod:`disagg_router.router.routing.kv_events`) applies
typed, range-checked events (:meth:`KvIndex.apply`) and clears an instance on a resync; the
``kv_aware`` policy asks :meth:`KvIndex.matched_blocks` on the request path. Everything runs on the
router's event loop; nothing here blocks or does I/O. The event types are those of
:mod:`disagg_router.router.routing.kv_wire`.

Per instance the index keeps vLLM's block hash -> the router's block key
(:func:`disagg_router.router.routing.block_keys.chain_keys` of the event's ``token_ids``, chained
from the key of ``parent_block_hash``) and a count per key. A stored block whose parent the index
does not know (its store was missed, or evicted from the index) is not indexed ("orphan"): the index
may then under-state what an instance holds, never over-state it. Blocks of LoRA adapters, with
extra hash keys (multimodal inputs, ``cache_salt``), of KV cache groups other than the first, or on
a medium other than the GPU/default one are not indexed either (a plain request cannot hit them).

Memory is bounded: at most ``max_blocks`` blocks per instance; beyond that the oldest indexed
block is forgotten (again only an under-statement). docs/router.md gives the measured size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from disagg_router.router.routing.block_keys import ROOT_KEY, chain_keys
from disagg_router.router.routing.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)

BlockHash = bytes | int


@dataclass
class InstanceBlocks:
    """The blocks one instance holds: vLLM hash -> router key (oldest first), keys counted."""

    by_hash: dict[BlockHash, bytes] = field(default_factory=dict)
    keys: dict[bytes, int] = field(default_factory=dict)

    def add(self, block_hash: BlockHash, key: bytes) -> None:
        if block_hash in self.by_hash:
            return
        self.by_hash[block_hash] = key
        self.keys[key] = self.keys.get(key, 0) + 1

    def remove(self, block_hash: BlockHash) -> None:
        key = self.by_hash.pop(block_hash, None)
        if key is None:
            return
        left = self.keys[key] - 1
        if left:
            self.keys[key] = left
        else:
            del self.keys[key]

    def evict_oldest(self) -> None:
        self.remove(next(iter(self.by_hash)))


@dataclass(frozen=True)
class ApplyResult:
    """What one batch did to an instance: blocks added, removed, skipped (orphans and blocks a
    plain request cannot hit) and whether the instance was cleared."""

    stored: int = 0
    removed: int = 0
    skipped: int = 0
    cleared: bool = False

    def plus(self, other: ApplyResult) -> ApplyResult:
        """Both results together (the stream applies a batch in parts)."""
        return ApplyResult(
            self.stored + other.stored,
            self.removed + other.removed,
            self.skipped + other.skipped,
            self.cleared or other.cleared,
        )


def _indexable(event: BlockStored) -> bool:
    if event.lora_id is not None or event.lora_name:
        return False
    if event.extra_keys and any(k is not None for k in event.extra_keys):
        return False
    return event.group_idx in (None, 0) and event.medium in (None, "GPU")


class KvIndex:
    """Per-instance block sets of one model, keyed by instance label."""

    def __init__(self, max_blocks: int) -> None:
        self._max_blocks = max_blocks
        self._instances: dict[str, InstanceBlocks] = {}
        self.block_size: int | None = None
        """vLLM's block size, learned from the first stored block (None until then)."""

    def blocks(self, label: str) -> int:
        """How many blocks the index holds for ``label``."""
        found = self._instances.get(label)
        return len(found.by_hash) if found else 0

    def labels(self) -> list[str]:
        return list(self._instances)

    def clear(self, label: str) -> None:
        """Forget everything ``label`` holds (a resync, a restart, the instance left)."""
        self._instances.pop(label, None)

    def apply(self, label: str, events: Iterable[KvEvent]) -> ApplyResult:
        """Apply typed events (:mod:`disagg_router.router.routing.kv_wire`) to ``label``, in
        order."""
        blocks = self._instances.setdefault(label, InstanceBlocks())
        stored = removed = skipped = 0
        cleared = False
        for event in events:
            if isinstance(event, BlockStored):
                added, left_out = self._store(blocks, event)
                stored, skipped = stored + added, skipped + left_out
            elif isinstance(event, BlockRemoved) and event.medium in (None, "GPU"):
                for block_hash in event.block_hashes:
                    blocks.remove(block_hash)
                removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks = self._instances[label] = InstanceBlocks()
                cleared = True
        return ApplyResult(stored, removed, skipped, cleared)

    def _store(self, blocks: InstanceBlocks, event: BlockStored) -> tuple[int, int]:
        hashes, size = event.block_hashes, event.block_size
        if not _indexable(event) or len(event.token_ids) // size != len(hashes):
            return 0, len(hashes)
        parent_hash = event.parent_block_hash
        parent = ROOT_KEY if parent_hash is None else blocks.by_hash.get(parent_hash)
        if parent is None:
            return 0, len(hashes)
        self.block_size = size
        keys = chain_keys(event.token_ids, size, parent)
        for block_hash, key in zip(hashes, keys, strict=True):
            blocks.add(block_hash, key)
            if len(blocks.by_hash) > self._max_blocks:
                blocks.evict_oldest()
        return len(hashes), 0

    def matched_blocks(self, label: str, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a request's chain, in order) ``label`` holds from the start."""
        found = self._instances.get(label)
        if found is None:
            return 0
        held = found.keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count
