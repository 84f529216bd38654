"""Transfer benchmark shape arithmetic (no NIXL)."""

from __future__ import annotations

import pytest

from bench.transfer import TransferSpec


def test_bytes_and_descriptors_per_write() -> None:
    spec = TransferSpec(regions=4, blocks_per_region=512, block_bytes=2048, blocks_per_write=256)
    assert spec.bytes_per_write == 4 * 256 * 2048
    assert spec.descs_per_write == 1024
    spec.validate()


@pytest.mark.parametrize(
    "kwargs", [{"blocks_per_write": 0}, {"blocks_per_write": 513}, {"iterations": 0}]
)
def test_bad_spec_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        TransferSpec(**kwargs).validate()
