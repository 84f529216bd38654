"""Wire protocol v1: round trips, version checks, malformed input (pure Python)."""

from __future__ import annotations

import json

import pytest

from disagg_router.connector.errors import ProtocolError
from disagg_router.connector.layout import LayoutSpec, RegionSpec
from disagg_router.connector.protocol import (
    NOTIF_PREFIX,
    PROTOCOL_VERSION,
    Notification,
    Registration,
    Reply,
    cancel_from_body,
    decode_notification,
    decode_reply,
    decode_request,
    encode_cancel,
    encode_notification,
    encode_registration,
    encode_reply,
    encode_request,
    registration_from_body,
)

LAYOUT = LayoutSpec(regions=(RegionSpec(4096, 256, 256, 10), RegionSpec(8192, 256, 256, 10)))


def _registration() -> Registration:
    return Registration(
        transfer_key="t:abc",
        d_request_id="cmpl-abc-0-deadbeef",
        p_engine_id="p0",
        d_agent_name="d-agent",
        d_agent_metadata=b"\x00\x01binary\xff",
        d_layout=LAYOUT,
        block_ids=((5, 3, 9),),
        first_block=2,
        budget_s=12.5,
    )


def test_registration_round_trip() -> None:
    kind, body = decode_request(encode_registration(_registration()))
    assert kind == "register"
    assert registration_from_body(body) == _registration()


def test_unknown_version_is_rejected_naming_both_versions() -> None:
    raw = json.loads(encode_request("ping", {}))
    raw["v"] = 99
    with pytest.raises(ProtocolError, match=r"version 99 .*speaks 1"):
        decode_request(json.dumps(raw).encode())
    with pytest.raises(ProtocolError, match="version None"):
        decode_reply(b'{"status": "accepted"}')


def test_malformed_messages_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_request(b"\xff\xfe")
    with pytest.raises(ProtocolError, match="bad registration"):
        registration_from_body({"v": PROTOCOL_VERSION, "transfer_key": "k"})
    with pytest.raises(ProtocolError, match="unknown reply status"):
        decode_reply(json.dumps({"v": PROTOCOL_VERSION, "status": "maybe"}).encode())
    with pytest.raises(ProtocolError, match="missing message type"):
        decode_request(json.dumps({"v": PROTOCOL_VERSION}).encode())


def test_reply_and_notification_round_trip() -> None:
    assert decode_reply(encode_reply(Reply("in_flight", "x"))) == Reply("in_flight", "x")
    note = Notification("failed", "r:cmpl-1-0", "cmpl-1-0-abcdef12", "prefill aborted")
    assert decode_notification(encode_notification(note)) == note


def test_foreign_notifications_are_not_ours() -> None:
    with pytest.raises(ProtocolError, match="not a connector notification"):
        decode_notification(b"cmpl-1:1")  # vLLM's own completion notif format
    bad = b"DPC1:" + json.dumps({"v": PROTOCOL_VERSION, "kind": "later"}).encode()
    with pytest.raises(ProtocolError, match="unknown notification kind"):
        decode_notification(bad)


def test_layout_compatibility_names_the_difference() -> None:
    other = LayoutSpec(regions=(RegionSpec(0, 256, 256, 99), RegionSpec(0, 512, 256, 99)))
    assert LAYOUT.compatible_with(other) is None  # strides and counts may differ
    assert "region count" in str(LAYOUT.compatible_with(LayoutSpec(regions=LAYOUT.regions[:1])))
    bigger = LayoutSpec(regions=(RegionSpec(0, 512, 512, 9), RegionSpec(0, 512, 512, 9)))
    assert "block bytes differ" in str(LAYOUT.compatible_with(bigger))
    assert LayoutSpec.from_json(LAYOUT.to_json()) == LAYOUT


def test_layout_fields_beyond_the_first_v1_peers_are_optional_both_ways() -> None:
    gpu = LayoutSpec(
        LAYOUT.regions,
        mem_type="VRAM",
        device_id=2,
        dtype="bfloat16",
        block_size=16,
        block_format="2:16,1:8,3:256",
    )
    assert LayoutSpec.from_json(gpu.to_json()) == gpu
    # A peer that states only regions and blocks_per_logical is a DRAM peer, compared by bytes.
    older = LayoutSpec.from_json({"regions": gpu.to_json()["regions"], "blocks_per_logical": 1})
    assert older == LAYOUT and older.mem_type == "DRAM"
    assert gpu.compatible_with(older) is None
    with pytest.raises(ProtocolError, match="mem_type"):
        LayoutSpec.from_json({**gpu.to_json(), "mem_type": "HBM"})


def test_tensor_parallel_fields_round_trip_and_default_to_rank_0() -> None:
    note = Notification("done", "t:abc", "d-1", p_rank=1)
    assert decode_notification(encode_notification(note)) == note
    v1 = {"v": 1, "kind": "done", "transfer_key": "k", "d_request_id": "d"}
    assert decode_notification(NOTIF_PREFIX + json.dumps(v1).encode()).p_rank == 0
    assert cancel_from_body(decode_request(encode_cancel("t:abc", 1))[1]) == ("t:abc", 1)
    assert cancel_from_body({"transfer_key": "k"}) == ("k", 0)  # a TP 1 peer's cancel
    ranked = LayoutSpec(LAYOUT.regions, head_bytes=128, tp_rank=1, tp_size=2, total_kv_heads=2)
    reg = Registration(**{**_registration().__dict__, "d_layout": ranked})
    assert registration_from_body(decode_request(encode_registration(reg))[1]) == reg


def test_a_layout_stating_heads_its_rank_does_not_hold_is_rejected() -> None:
    raw = LayoutSpec(LAYOUT.regions, tp_rank=1, tp_size=2, total_kv_heads=2).to_json()
    raw["kv_heads"] = [0, 1]
    with pytest.raises(ProtocolError, match=r"kv_heads \[0, 1\] are not rank 1 of 2's \[1, 2\]"):
        LayoutSpec.from_json(raw)
