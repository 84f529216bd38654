"""The device check refuses a ``--tp`` its KV cache cannot split, before starting any process."""

from __future__ import annotations

import pytest

from bench.device_check import parse_args, run


@pytest.mark.parametrize("tp", ["0", "3"])
def test_tp_must_divide_the_kv_heads(tp: str) -> None:
    with pytest.raises(SystemExit, match=f"--tp {tp} must divide the cache's 4 KV heads"):
        run(parse_args(["--memory", "dram", "--tp", tp]), None)


def test_tp_defaults_to_one() -> None:
    assert parse_args([]).tp == 1
