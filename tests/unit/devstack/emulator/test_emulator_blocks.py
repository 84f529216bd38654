"""The emulator's paged KV cache (``devstack.emulator.blocks``): allocation and usage, prefix
caching, LRU eviction in vLLM's order (least recently freed first, a request's last block before
its first), the ``BlockStored``/``BlockRemoved`` events it reports, chained block hashes, and that
those events are what the router's decoder and KV index read."""

from __future__ import annotations

import time

import msgspec

from devstack.emulator.blocks import BlockPool, block_hashes
from disagg_router.router.routing.block_keys import chain_keys
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import BlockRemoved, BlockStored, typed_events

SIZE = 4


def _tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def _cached_request(pool: BlockPool, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate the blocks of ``tokens``, cache its full ones; its blocks and their hashes."""
    blocks = pool.allocate(-(-len(tokens) // pool.block_size))
    assert blocks is not None
    hashes = block_hashes(tokens, pool.block_size)
    pool.cache(blocks, hashes, tokens, 0)
    return blocks, hashes


def test_allocate_and_free_count_blocks_and_usage() -> None:
    pool = BlockPool(8, SIZE)
    assert (pool.free_blocks, pool.usage) == (8, 0.0)
    first = pool.allocate(2)
    second = pool.allocate(4)
    assert first is not None and second is not None
    assert len(set(first + second)) == 6
    assert (pool.free_blocks, pool.usage) == (2, 0.75)
    assert pool.allocate(3) is None  # more than is free: nothing is taken
    assert pool.free_blocks == 2
    pool.free(first)
    pool.free(second)
    assert (pool.free_blocks, pool.usage) == (8, 0.0)


def test_cached_blocks_are_found_by_longest_prefix_and_taken_out_of_the_free_count() -> None:
    pool = BlockPool(8, SIZE)
    tokens = _tokens(1, 10)  # two full blocks and a partial one
    blocks, hashes = _cached_request(pool, tokens)
    assert len(hashes) == 2
    pool.free(blocks)
    assert pool.free_blocks == 8  # cached blocks stay allocatable
    assert pool.longest_prefix(hashes) == blocks[:2]
    # a longer request sharing only the first block finds just that one
    other = block_hashes(tokens[:SIZE] + _tokens(100, SIZE), SIZE)
    assert pool.longest_prefix(other) == blocks[:1]
    assert pool.longest_prefix(block_hashes(_tokens(200, 8), SIZE)) == []
    pool.take(blocks[:2])
    assert pool.free_blocks == 6
    pool.take(blocks[:1])  # a second request on the same block: no second hold on the count
    assert pool.free_blocks == 6
    pool.free(blocks[:1])
    assert pool.free_blocks == 6  # still held by the first taker
    pool.free(blocks[:2])
    assert pool.free_blocks == 8


def test_eviction_takes_the_least_recently_freed_block_and_a_requests_last_block_first() -> None:
    pool = BlockPool(4, SIZE)
    a_blocks, a_hashes = _cached_request(pool, _tokens(1, 2 * SIZE))
    b_blocks, b_hashes = _cached_request(pool, _tokens(100, 2 * SIZE))
    pool.drain_events()
    pool.free(a_blocks)  # freed first: evicted first
    pool.free(b_blocks)
    order = []
    for _ in range(4):
        got = pool.allocate(1)
        assert got is not None
        order.append(got[0])
    assert order == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    removed = pool.drain_events()
    assert removed == [
        BlockRemoved(block_hashes=[a_hashes[1]], medium="GPU"),
        BlockRemoved(block_hashes=[a_hashes[0]], medium="GPU"),
        BlockRemoved(block_hashes=[b_hashes[1]], medium="GPU"),
        BlockRemoved(block_hashes=[b_hashes[0]], medium="GPU"),
    ]
    assert pool.longest_prefix(a_hashes) == []


def test_eviction_of_a_last_block_keeps_the_prefix_before_it() -> None:
    pool = BlockPool(4, SIZE)
    a_blocks, a_hashes = _cached_request(pool, _tokens(1, 2 * SIZE))
    b_blocks, _ = _cached_request(pool, _tokens(100, 2 * SIZE))
    pool.free(a_blocks)
    pool.free(b_blocks)
    pool.drain_events()
    assert pool.allocate(1) == [a_blocks[1]]
    assert pool.drain_events() == [BlockRemoved(block_hashes=[a_hashes[1]], medium="GPU")]
    assert pool.longest_prefix(a_hashes) == a_blocks[:1]


def test_cache_reports_one_block_stored_event_per_call() -> None:
    pool = BlockPool(8, SIZE)
    tokens = _tokens(1, 3 * SIZE + 1)
    blocks = pool.allocate(4)
    assert blocks is not None
    hashes = block_hashes(tokens, SIZE)
    pool.cache(blocks, hashes[:2], tokens, 0)
    assert pool.drain_events() == [
        BlockStored(
            block_hashes=list(hashes[:2]),
            token_ids=tokens[: 2 * SIZE],
            block_size=SIZE,
            parent_block_hash=None,
            medium="GPU",
        )
    ]
    assert pool.drain_events() == []  # drained
    pool.cache(blocks, hashes, tokens, 2)  # only the block after the first two
    (event,) = pool.drain_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [hashes[2]]
    assert event.token_ids == tokens[2 * SIZE : 3 * SIZE]
    assert event.parent_block_hash == hashes[1]
    assert event.block_size == SIZE


def test_a_block_whose_hash_is_cached_elsewhere_is_not_cached_again() -> None:
    pool = BlockPool(8, SIZE)
    tokens = _tokens(1, 2 * SIZE)
    first, hashes = _cached_request(pool, tokens)
    pool.drain_events()
    second = pool.allocate(2)
    assert second is not None
    pool.cache(second, hashes, tokens, 0)
    assert pool.drain_events() == []
    assert pool.longest_prefix(hashes) == first


def test_block_hashes_are_chained_and_cover_full_blocks_only() -> None:
    tokens = _tokens(1, 2 * SIZE)
    base = block_hashes(tokens, SIZE)
    assert len(base) == 2
    assert len(block_hashes(_tokens(1, 3 * SIZE - 1), SIZE)) == 2
    assert block_hashes(_tokens(1, SIZE - 1), SIZE) == []
    assert block_hashes(tokens, SIZE) == base  # deterministic
    assert all(0 <= h < 2**64 for h in base)
    same_start = block_hashes(tokens[:SIZE] + _tokens(100, SIZE), SIZE)
    assert same_start[0] == base[0] and same_start[1] != base[1]
    # a different first block changes every hash, even of identical later blocks
    other_start = block_hashes([99, *tokens[1:]], SIZE)
    assert all(a != b for a, b in zip(other_start, base, strict=True))
    # the chain continues from a parent
    assert block_hashes(tokens[SIZE:], SIZE, parent=base[0]) == base[1:]


def test_events_round_trip_through_the_routers_decoder_and_index() -> None:
    pool = BlockPool(4, SIZE)
    tokens = _tokens(1, 3 * SIZE + 2)
    blocks = pool.allocate(4)
    assert blocks is not None
    hashes = block_hashes(tokens, SIZE)
    pool.cache(blocks, hashes[:2], tokens, 0)
    pool.cache(blocks, hashes, tokens, 2)
    events = pool.drain_events()
    assert len(events) == 2
    payload = msgspec.msgpack.encode([time.time(), events])  # the fleet's framing
    decoded = typed_events(payload, max_blocks=1000)
    assert decoded == events

    index = KvIndex(max_blocks=1000)
    applied = index.apply("p0", decoded)
    assert (applied.stored, applied.skipped) == (3, 0)
    keys = chain_keys(tokens, SIZE)
    assert index.matched_blocks("p0", keys) == 3
    assert index.matched_blocks("p0", chain_keys(tokens[:SIZE] + _tokens(100, 8), SIZE)) == 1

    # evicting the last full block shortens the match the router computes (the partial
    # block after it, never cached, goes first)
    pool.free(blocks)
    assert pool.allocate(2) == [blocks[3], blocks[2]]
    removal = typed_events(msgspec.msgpack.encode([time.time(), pool.drain_events()]), 1000)
    assert removal == [BlockRemoved(block_hashes=[hashes[2]], medium="GPU")]
    index.apply("p0", removal)
    assert index.matched_blocks("p0", keys) == 2
