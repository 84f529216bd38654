"""The P/D contract: each message's builder and reader agree, and a reader names what is wrong."""

from __future__ import annotations

import pytest

from connector.contract import (
    DecodeLeg,
    PeerIdentity,
    PrefillAnswer,
    PrefillLeg,
    decode_leg_params,
    prefill_answer_params,
    prefill_leg_params,
    read_decode_leg,
    read_prefill_answer,
    read_prefill_leg,
)
from connector.errors import ContractError

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
