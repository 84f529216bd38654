"""The emulated engine's paged KV cache: fixed-size blocks, prefix caching, LRU eviction, and
the KV events vLLM publishes about them.

Who uses it: :class:`devstack.emulator.scheduler.Scheduler` only (one pool per engine, on the
engine's event loop; nothing here is thread-safe or does I/O). It behaves like vLLM v1's block
pool: a full block is cached under a hash chained from its parent's hash and its tokens; freed
blocks go to the end of a free queue (a request's last block first, so its prefix stays longest);
allocation takes the queue's head, evicting the cached block there. Every cached block is
reported in a ``BlockStored`` event and every eviction in a ``BlockRemoved`` one, as vLLM does
when ``--kv-events-config`` is set; :meth:`BlockPool.drain_events` hands them over.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from disagg_router.router.routing.kv_wire import BlockRemoved, BlockStored, KvEvent

_MASK = (1 << 64) - 1


def block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (unsigned 64-bit ints, like vLLM's
    default event hashes; deterministic in a process: ints and tuples hash without a seed)."""
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]))) & _MASK
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens; ids are ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._events: list[KvEvent] = []
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found

    @property
    def free_blocks(self) -> int:
        """Blocks that an allocation may take (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use by requests (vLLM's ``kv_cache_usage_perc``, 0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_blocks_besides(self, blocks: Sequence[int]) -> int:
        """Free blocks an allocation may take while ``blocks`` (cached, about to be taken) are
        kept."""
        return len(self._free) - sum(1 for b in set(blocks) if self._refs[b] == 0)

    def longest_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of ``hashes`` (not yet taken)."""
        found: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def count_lookup(self, tokens: int, hit: int) -> None:
        """Count a prefix-cache lookup of ``tokens`` prompt tokens of which ``hit`` were cached."""
        self.queries += tokens
        self.hits += hit

    def take(self, blocks: Sequence[int]) -> None:
        """Hold cached ``blocks`` (from :meth:`longest_prefix`) for one more request."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting the least recently freed cached ones), or ``None`` when
        fewer than ``n`` are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is None:
            return
        self._hash_of[block] = None
        del self._cached[h]
        self._events.append(BlockRemoved(block_hashes=[h], medium="GPU"))

    def free(self, blocks: Sequence[int]) -> None:
        """Release one request's hold on ``blocks`` (given in the request's order)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def cache(
        self, blocks: Sequence[int], hashes: Sequence[int], tokens: Sequence[int], first: int
    ) -> None:
        """Cache the full blocks ``blocks[first:len(hashes)]`` of a request (``tokens`` are the
        request's tokens, ``hashes`` its full blocks' chained hashes) and report them in one
        ``BlockStored`` event. A block whose hash is already cached elsewhere stays uncached
        (vLLM keeps the first copy too)."""
        stored: list[int] = []
        start = first
        for i in range(first, len(hashes)):
            h = hashes[i]
            if h in self._cached or self._hash_of[blocks[i]] is not None:
                if stored:
                    self._store(stored, tokens, start, hashes)
                stored, start = [], i + 1
                continue
            self._cached[h] = blocks[i]
            self._hash_of[blocks[i]] = h
            stored.append(h)
        if stored:
            self._store(stored, tokens, start, hashes)

    def _store(
        self, stored: list[int], tokens: Sequence[int], start: int, hashes: Sequence[int]
    ) -> None:
        size = self.block_size
        parent = hashes[start - 1] if start > 0 else None
        named: list[bytes | int] = list(stored)
        event = BlockStored(
            block_hashes=named,
            token_ids=list(tokens[start * size : (start + len(stored)) * size]),
            block_size=size,
            parent_block_hash=parent,
            medium="GPU",
        )
        self._events.append(event)

    def drain_events(self) -> list[KvEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
