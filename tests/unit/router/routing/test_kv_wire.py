"""The typed decoder of vLLM's KV event messages: what real vLLM sends decodes whole; every
field of the wrong type or out of range, an unknown event type and an event over the blocks
bound are skipped alone with their reason; a payload that is no batch is refused whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from disagg_router.router.routing.block_keys import chain_keys
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import (
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    Rejected,
    decode_batch,
    decode_event,
    stored_slices,
)

RECORDING = Path(__file__).parents[1] / "recorded" / "vllm_kv_events.json"
MAX_BLOCKS = 65536
# vllm.distributed.kv_events (vLLM 0.32) encoding KVEventBatch(ts=1.5, data_parallel_rank=1,
# events=[BlockStored(block_hashes=[b"\x01" * 32, 2**64 - 1], parent_block_hash=7,
# token_ids=[5] * 32, block_size=16, lora_id=None, medium="GPU", lora_name=None,
# extra_keys=[None, ("salt",)], group_idx=0, kv_cache_spec_kind="full", locality="LOCAL"),
# BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0), AllBlocksCleared()])
VLLM_032 = bytes.fromhex(
    "93cb3ff8000000000000938ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c420"
    "0101010101010101010101010101010101010101010101010101010101010101cfffffffffffffffffb1706172"
    "656e745f626c6f636b5f6861736807a9746f6b656e5f696473dc0020050505050505050505050505050505050505"
    "0505050505050505050505050505aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c0aa65787472615f6b65797392c091a473616c74a967726f75705f69647800b26b76"
    "5f63616368655f737065635f6b696e64a466756c6ca86c6f63616c697479a54c4f43414c84a474797065ac426c"
    "6f636b52656d6f766564ac626c6f636b5f6861736865739103a66d656469756da3475055a967726f75705f6964"
    "780081a474797065b0416c6c426c6f636b73436c656172656401"
)


def _events(payload: bytes) -> list[Any]:
    return [decode_event(raw, MAX_BLOCKS) for raw in decode_batch(payload).events]


def _one(event: dict[str, Any]) -> Any:
    (found,) = _events(msgspec.msgpack.encode([1.0, [event]]))
    return found


def _stored(**fields: Any) -> dict[str, Any]:
    good = {"block_hashes": [1, 2], "token_ids": list(range(32)), "block_size": 16}
    return {"type": "BlockStored", **good, "parent_block_hash": None, **fields}


def test_every_recorded_vllm_batch_decodes_whole() -> None:
    frames = json.loads(RECORDING.read_text())["frames"]
    events = [e for frame in frames for e in _events(bytes.fromhex(frame[-1]))]
    assert events and not [e for e in events if isinstance(e, Rejected)]
    assert {type(e) for e in events} == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_what_vllm_032_encodes_decodes_with_bytes_and_uint64_hashes() -> None:
    batch = decode_batch(VLLM_032)
    assert batch.ts == 1.5
    stored, removed, cleared = (decode_event(raw, MAX_BLOCKS) for raw in batch.events)
    assert stored == BlockStored(
        [b"\x01" * 32, 2**64 - 1],
        [5] * 32,
        16,
        parent_block_hash=7,
        medium="GPU",
        extra_keys=[None, ["salt"]],
        group_idx=0,
    )
    assert removed == BlockRemoved([3], medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"block_hashes": [1, [[2]]]}, "$.block_hashes[1]"),
        ({"block_hashes": 5}, "$.block_hashes"),
        ({"block_hashes": ["zzzzzz", 2]}, "$.block_hashes[0]"),
        ({"block_hashes": [None, 2]}, "$.block_hashes[0]"),
        ({"block_hashes": [1.5, 2]}, "$.block_hashes[0]"),
        ({"block_hashes": [b"x" * 65, 2]}, "$.block_hashes[0]"),
        ({"parent_block_hash": "zzzzzz"}, "$.parent_block_hash"),
        ({"token_ids": "x" * 32}, "$.token_ids"),
        ({"token_ids": [-(2**63), *range(31)]}, "$.token_ids[0]"),
        ({"token_ids": [2**31, *range(31)]}, "$.token_ids[0]"),
        ({"block_size": 0}, "$.block_size"),
        ({"block_size": "16"}, "$.block_size"),
        ({"medium": 3}, "$.medium"),
        ({"group_idx": -1}, "$.group_idx"),
    ],
)
def test_a_store_with_a_field_of_the_wrong_type_or_range_is_rejected(
    fields: dict[str, Any], where: str
) -> None:
    found = _one(_stored(**fields))
    assert isinstance(found, Rejected) and found.reason == "invalid"
    assert where in found.detail


@pytest.mark.parametrize("hashes", [[0, 1, [300]], [{"k": 1}], [None], 5, "ab"])
def test_a_removal_with_bad_hashes_is_rejected(hashes: Any) -> None:
    found = _one({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"})
    assert isinstance(found, Rejected) and found.reason == "invalid"


def test_events_that_are_no_event_are_rejected_alone() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [5, {"no": "type"}, {"type": "Later"}, _stored(), {"type": "AllBlocksCleared"}]]
    )
    found = _events(payload)
    reasons = [e.reason if isinstance(e, Rejected) else type(e).__name__ for e in found]
    assert reasons == ["invalid", "invalid", "unknown_type", "BlockStored", "AllBlocksCleared"]


def test_an_event_over_the_blocks_bound_is_rejected_before_its_hashes_are_read() -> None:
    # hashes of the wrong type past the bound: only the bound can name the reason
    over = _stored(block_hashes=["x"] * (MAX_BLOCKS + 1))
    found = _one(over)
    assert isinstance(found, Rejected) and found.reason == "too_many_blocks"
    ten_million = _stored(block_hashes=list(range(10_000_000)))
    found = _one(ten_million)
    assert isinstance(found, Rejected) and found.reason == "too_many_blocks"
    assert isinstance(_one(_stored(block_hashes=list(range(MAX_BLOCKS)))), BlockStored)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode([-1.0, []]),
        msgspec.msgpack.encode([float("nan"), []]),
        b"\x92\xcb" + bytes(8) + b"\x91" * 100_000 + b"\x01",  # events nested 100,000 deep
    ],
)
def test_a_payload_that_is_no_batch_is_refused_whole(payload: bytes) -> None:
    with pytest.raises(BadBatch) as caught:
        decode_batch(payload)
    assert caught.value.reason == "undecodable"


def test_a_large_store_applied_in_slices_indexes_as_the_whole() -> None:
    tokens = list(range(16 * 100))
    event = BlockStored(list(range(100)), tokens, 16)
    parts = list(stored_slices(event, 7))
    assert len(parts) == 15 and sum(len(p.block_hashes) for p in parts) == 100
    whole, sliced = KvIndex(max_blocks=1000), KvIndex(max_blocks=1000)
    whole.apply("a", [event])
    for part in parts:
        sliced.apply("a", [part])
    keys = chain_keys(tokens, 16)
    assert sliced.matched_blocks("a", keys) == whole.matched_blocks("a", keys) == 100
