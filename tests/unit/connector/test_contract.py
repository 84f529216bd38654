"""The P/D contract: each message's builder and reader agree, and a reader names what is wrong."""

from __future__ import annotations

import pytest

from disagg_router.connector.contract import (
    DecodeLeg,
    EngineShape,
    PeerIdentity,
    PrefillAnswer,
    PrefillLeg,
    decode_leg_params,
    engine_shape_params,
    identity_probe_params,
    is_identity_probe,
    pairing_refusal,
    prefill_answer_params,
    prefill_leg_params,
    read_decode_leg,
    read_engine_shape,
    read_prefill_answer,
    read_prefill_leg,
)
from disagg_router.connector.errors import ContractError

PEER = PeerIdentity("p0", "10.0.0.1", 5600, tp_size=1, pp_size=1)


def test_prefill_leg_reads_back() -> None:
    assert read_prefill_leg(prefill_leg_params("t1")) == PrefillLeg("t1", probe=False)
    assert read_prefill_leg(prefill_leg_params("t1", probe=True)) == PrefillLeg("t1", probe=True)
    assert read_prefill_leg({"do_remote_decode": True}) == PrefillLeg(None, probe=False)
    assert read_prefill_leg(None) is None
    assert read_prefill_leg(_decode_leg()) is None


def _decode_leg() -> dict[str, object]:
    return decode_leg_params(
        engine_id="p0",
        host="10.0.0.1",
        port=5600,
        tp_size=1,
        pp_size=1,
        request_id="cmpl-r-0-0123abcd",
        transfer_id="t2",
    )


def test_decode_leg_reads_back() -> None:
    assert read_decode_leg(_decode_leg()) == DecodeLeg(PEER, "cmpl-r-0-0123abcd", "t2")
    assert read_decode_leg(prefill_leg_params("t")) is None
    assert read_decode_leg({}) is None


def test_prefill_answer_reads_back() -> None:
    params = prefill_answer_params(
        engine_id="p0",
        host="10.0.0.1",
        port=5600,
        request_id="cmpl-r-0-0123abcd",
        block_ids=[3, 4],
        num_tokens=40,
        transfer_id="t3",
    )
    assert read_prefill_answer(params) == PrefillAnswer(
        PEER, "cmpl-r-0-0123abcd", (3, 4), 40, "push", "t3"
    )
    # vLLM's own NIXL connectors send the identity and less: the rest reads as None.
    minimal = {"remote_engine_id": "p0", "remote_host": "10.0.0.1", "remote_port": "5600"}
    assert read_prefill_answer(minimal) == PrefillAnswer(PEER, None, None, None, None, None)


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"do_remote_prefill": True, "remote_engine_id": "p0"}, "remote_host, remote_port"),
        (
            {
                "do_remote_prefill": True,
                "remote_engine_id": "p0",
                "remote_host": "h",
                "remote_port": "x",
            },
            "kv_transfer_params.remote_port",
        ),
        (
            {
                "do_remote_prefill": True,
                "remote_engine_id": "p0",
                "remote_host": "h",
                "remote_port": 1,
                "tp_size": True,
            },
            "kv_transfer_params.tp_size",
        ),
    ],
)
def test_readers_name_the_missing_or_bad_field(params: dict[str, object], names: str) -> None:
    with pytest.raises(ContractError, match=names):
        read_decode_leg(params)
    with pytest.raises(ContractError, match=names):
        read_prefill_answer(params)


def test_an_answer_whose_blocks_are_not_a_list_is_refused() -> None:
    params = {"remote_engine_id": "p0", "remote_host": "h", "remote_port": 1}
    with pytest.raises(ContractError, match="remote_block_ids"):
        read_prefill_answer({**params, "remote_block_ids": 7})


def _shape(tp: int = 1, pp: int = 1, block: int = 16, heads: int | None = None) -> EngineShape:
    return EngineShape(tp_size=tp, pp_size=pp, block_size=block, num_kv_heads=heads)


def test_engine_shape_reads_back_and_is_absent_without_block_size() -> None:
    shape = _shape(tp=2, block=128, heads=8)
    assert read_engine_shape(engine_shape_params(shape)) == shape
    assert read_engine_shape(engine_shape_params(_shape())) == _shape()
    # vLLM's NIXL connectors answer tp_size alone: no shape, not an error.
    assert read_engine_shape({"tp_size": 2, "pp_size": 1}) is None
    assert read_engine_shape(None) is None
    answer = prefill_answer_params(
        engine_id="p0", host="h", port=1, request_id="r", block_ids=[], num_tokens=1
    )
    assert read_engine_shape(answer | engine_shape_params(shape)) == shape
    assert read_prefill_answer(answer | engine_shape_params(shape)).peer.tp_size == 2


@pytest.mark.parametrize(
    "params, names",
    [
        ({"block_size": "x"}, "block_size"),
        ({"block_size": 16, "tp_size": 0}, "tp_size"),
        ({"block_size": 16, "num_kv_heads": True}, "num_kv_heads"),
        ({"block_size": -16}, "block_size"),
    ],
)
def test_engine_shape_reader_names_the_bad_field(params: dict[str, object], names: str) -> None:
    with pytest.raises(ContractError, match=names):
        read_engine_shape(params)


def test_identity_probe_params_mark_a_probe_and_no_leg() -> None:
    params = identity_probe_params()
    assert is_identity_probe(params) and not is_identity_probe({"do_remote_decode": True})
    assert read_prefill_leg(params) is None and read_decode_leg(params) is None


@pytest.mark.parametrize(
    "p, d",
    [
        (_shape(), _shape()),
        (_shape(tp=2), _shape(tp=1)),
        (_shape(tp=1), _shape(tp=2)),
        (_shape(tp=2), _shape(tp=2)),
        (_shape(tp=4), _shape(tp=2)),
        (_shape(tp=2, heads=8), _shape(tp=1, heads=8)),
        (_shape(tp=4, heads=2), _shape(tp=4, heads=2)),
        (_shape(tp=1, heads=1), _shape(tp=2, heads=1)),  # D's ranks replicate the head
        (_shape(pp=2), _shape()),  # each stage of P writes its own layers
        (_shape(tp=2, pp=2), _shape(tp=2)),
    ],
)
def test_pairs_of_any_tp_sizes_dividing_one_another_are_served(
    p: EngineShape, d: EngineShape
) -> None:
    assert pairing_refusal(p, d) is None


@pytest.mark.parametrize(
    "p, d, reason",
    [
        (_shape(tp=2), _shape(tp=3), "P tp_size=2 and D tp_size=3: neither divides the other"),
        (_shape(tp=3), _shape(tp=2), "P tp_size=3 and D tp_size=2: neither divides the other"),
        (_shape(), _shape(pp=2), "D pp_size=2 (P pp_size=1): D must have pp_size=1"),
        (_shape(block=16), _shape(block=32), "P block_size=16 and D block_size=32 differ"),
        (_shape(heads=8), _shape(heads=4), "P num_kv_heads=8 and D num_kv_heads=4 differ"),
    ],
)
def test_pairs_the_connector_refuses_name_both_values(
    p: EngineShape, d: EngineShape, reason: str
) -> None:
    assert pairing_refusal(p, d) == reason


def test_heads_only_count_when_both_report_them() -> None:
    assert pairing_refusal(_shape(heads=8), _shape()) is None
    assert pairing_refusal(_shape(tp=2), _shape(tp=1, heads=1)) is None
