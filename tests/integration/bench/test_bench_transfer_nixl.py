"""Connector WRITE path and bare NIXL WRITE both move the data between two real processes."""

from __future__ import annotations

import pytest

from bench.transfer import run_transfer
from bench.transfer_spec import TransferSpec

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def test_both_kinds_complete_and_notify() -> None:
    pytest.importorskip("nixl")
    spec = TransferSpec(
        regions=2,
        blocks_per_region=16,
        block_bytes=1024,
        blocks_per_write=8,
        iterations=3,
        warmups=1,
        rounds=1,
    )
    data = run_transfer(spec)
    assert [r["kind"] for r in data["rounds"]] == [
        "bare",
        "connector",
        "bare-notify",
        "connector-path",
    ]
    for row in data["rounds"][:2]:
        # Every WRITE's notification reached the target process.
        assert row["notifications_received"] == row["notifications_expected"] == 4
        assert row["throughput_gbps"] > 0
    for row in data["rounds"]:
        assert row["median_throughput_gbps"] > 0
    assert data["bytes_per_write"] == 2 * 8 * 1024
    assert data["connector_over_bare_throughput"] == data["path_connector_over_bare_throughput"]
    assert data["endpoint_connector_over_bare_throughput"] is not None


def test_two_p_ranks_write_their_shares_into_one_d() -> None:
    """P TP 2 -> D TP 1: both ranks' shares land at their offsets in every block, D has each
    rank's notification per iteration, and the ratio keys name the TP."""
    pytest.importorskip("nixl")
    spec = TransferSpec(
        regions=2,
        blocks_per_region=16,
        block_bytes=1024,
        blocks_per_write=8,
        iterations=3,
        warmups=1,
        rounds=1,
        p_tp=2,
    )
    data = run_transfer(spec, ("bare", "connector"))
    assert [r["kind"] for r in data["rounds"]] == ["bare", "connector"]
    for row in data["rounds"]:
        assert row["byte_exact"] is True
        assert row["notifications_received"] == row["notifications_expected"] == 2 * 4
        assert row["median_throughput_gbps"] > 0
    assert data["bytes_per_write"] == 2 * 8 * 1024  # whole blocks: both ranks' shares
    assert data["spec"]["p_tp"] == 2
    assert (
        data["connector_over_bare_throughput_p_tp2"]
        == (data["endpoint_connector_over_bare_throughput_p_tp2"])
    )
    assert data["connector_over_bare_throughput_p_tp2"] is not None
    assert "connector_over_bare_throughput" not in data
