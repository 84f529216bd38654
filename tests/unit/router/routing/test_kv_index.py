"""The KV index and block keys on KV events recorded from a real vLLM CPU instance.

The recording (recorded/vllm_kv_events.json, made by ``python -m devstack.record_kv_events``)
holds every frame one vLLM published while serving a scripted set of requests, how many frames
had arrived before each request, each request's prompt token ids (vLLM's ``/tokenize``) and the
cached tokens vLLM reported for it.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest

from disagg_router.router.routing.block_keys import chain_keys
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import BadBatch, KvEvent, decode_batch, typed_events

RECORDING = Path(__file__).parents[1] / "recorded" / "vllm_kv_events.json"


def _recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return data


def _batches(frames: list[list[str]]) -> list[list[KvEvent]]:
    return [typed_events(bytes.fromhex(frame[-1]), 65536) for frame in frames]


def _events(kind: str) -> list[Any]:
    found = (e for batch in _batches(_recording()["frames"]) for e in batch)
    return [e for e in found if type(e).__name__ == kind]


def test_the_recording_has_stores_removals_and_a_clear() -> None:
    assert _events("BlockStored") and _events("BlockRemoved") and _events("AllBlocksCleared")


def test_predicted_cached_tokens_equal_what_vllm_reported_for_every_recorded_request() -> None:
    """Replaying the events published before each request, the index predicts exactly the
    cached tokens vLLM then reported for it."""
    record = _recording()
    batches = _batches(record["frames"])
    for request in record["requests"]:
        index = KvIndex(max_blocks=10_000)
        for batch in batches[: request["frames_before"]]:
            index.apply("a0", batch)
        size = _events("BlockStored")[0].block_size
        ids = request["prompt_token_ids"]
        keys = chain_keys(ids[: (len(ids) - 1) // size * size], size)
        predicted = size * index.matched_blocks("a0", keys)
        assert predicted == request["usage"]["prompt_tokens_details"]["cached_tokens"], request


def test_some_recorded_request_was_a_partial_hit() -> None:
    cached = [
        (r["usage"]["prompt_tokens_details"]["cached_tokens"], r["usage"]["prompt_tokens"])
        for r in _recording()["requests"]
    ]
    assert any(0 < hit < total - 128 for hit, total in cached)
    assert any(hit == 0 for hit, _ in cached)


def test_vllm_block_hashes_are_sha256_of_the_router_blocks() -> None:
    """The facts docs/router.md states: with the default sha256 and no PYTHONHASHSEED, vLLM's
    block hash is sha256(pickle((parent hash, block token ids, extra keys))) chained from
    sha256(pickle("vllm-none-hash")), over the same token blocks the router keys; the events
    carry its low 64 bits as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default)."""
    none_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    full: dict[int, bytes] = {}  # an event's int hash -> the whole sha256 it was cut from
    checked = 0
    for event in _events("BlockStored"):
        parent_int = event.parent_block_hash
        parent = none_hash if parent_int is None else full[parent_int]
        size = event.block_size
        tokens = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            block = tuple(tokens[i * size : (i + 1) * size])
            digest = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
            assert block_hash == int.from_bytes(digest, "big") & (2**64 - 1)
            full[block_hash] = parent = digest
            checked += 1
    assert checked > 0


def test_the_replay_socket_returned_the_same_payloads_as_the_live_stream() -> None:
    record = _recording()
    live = [[f[1], hashlib.sha256(bytes.fromhex(f[2])).hexdigest()] for f in record["frames"]]
    replayed = [f for f in record["replay"] if f[0] != "ff" * 8]
    assert replayed == live


def test_removed_and_cleared_blocks_leave_the_index() -> None:
    index = KvIndex(max_blocks=10_000)
    peak = 0
    for batch in _batches(_recording()["frames"]):
        result = index.apply("a0", batch)
        peak = max(peak, index.blocks("a0"))
        if any(type(e).__name__ == "BlockRemoved" for e in batch):
            assert result.removed > 0
    assert peak > 0
    assert index.blocks("a0") == 0  # the recording ends with /reset_prefix_cache


def test_a_block_whose_parent_was_missed_is_not_indexed() -> None:
    stored = [e for e in _events("BlockStored") if e.parent_block_hash is not None]
    index = KvIndex(max_blocks=10_000)
    result = index.apply("a0", [stored[0]])
    assert (result.stored, result.skipped) == (0, len(stored[0].block_hashes))
    assert index.blocks("a0") == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"lora_name": "adapter"},
        {"lora_id": 3},
        {"extra_keys": [["salt"]]},
        {"medium": "CPU"},
        {"group_idx": 1},
    ],
)
def test_blocks_a_plain_request_cannot_hit_are_not_indexed(extra: dict[str, Any]) -> None:
    first = next(e for e in _events("BlockStored") if e.parent_block_hash is None)
    index = KvIndex(max_blocks=10_000)
    index.apply("a0", [msgspec.structs.replace(first, **extra)])
    assert index.blocks("a0") == 0


def test_the_index_is_bounded_per_instance_and_forgets_the_oldest_blocks() -> None:
    first = next(e for e in _events("BlockStored") if e.parent_block_hash is None)
    size = first.block_size
    tokens = list(range(size * 5))
    hashes: list[bytes | int] = [b"h%d" % i for i in range(5)]
    event = msgspec.structs.replace(first, token_ids=tokens, block_hashes=hashes)
    index = KvIndex(max_blocks=3)
    index.apply("a0", [event])
    keys = chain_keys(tokens, size)
    assert index.blocks("a0") == 3
    assert index.matched_blocks("a0", keys) == 0  # the oldest (first) blocks were forgotten
    assert index.matched_blocks("a0", keys[2:]) == 3  # the newest three stay
    index.apply("b0", [event])
    assert index.blocks("b0") == 3 and index.blocks("a0") == 3


def test_instances_are_indexed_apart_and_cleared_alone() -> None:
    batches = _batches(_recording()["frames"])
    index = KvIndex(max_blocks=10_000)
    index.apply("a0", batches[0])
    assert index.blocks("a0") > 0 and index.blocks("b0") == 0
    index.clear("a0")
    assert index.blocks("a0") == 0


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode(["x", []]),
        b"\x92\x01" + b"\x91" * 100_000 + b"\x01",  # msgpack nested 100,000 deep
    ],
)
def test_a_malformed_payload_is_not_a_batch(payload: bytes) -> None:
    with pytest.raises(BadBatch) as caught:
        decode_batch(payload)
    assert caught.value.reason == "undecodable"
