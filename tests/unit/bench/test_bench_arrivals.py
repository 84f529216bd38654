"""Arrival-process statistics with a fixed seed (deterministic, no clocks)."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.arrivals import arrival_offsets


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *offsets[:-1]], offsets, strict=True)]


def test_poisson_rate_and_exponential_shape() -> None:
    n, rate = 20000, 4.0
    offsets = arrival_offsets(n, rate, burstiness=1.0, seed=7)
    assert len(offsets) == n
    assert offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(n / rate)  # rescaled like vllm bench serve
    gaps = _gaps(offsets)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=1e-9)
    # Exponential: coefficient of variation 1.
    cv = statistics.pstdev(gaps) / mean
    assert cv == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_variance(burstiness: float) -> None:
    gaps = _gaps(arrival_offsets(20000, 2.0, burstiness=burstiness, seed=3))
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_seed_is_reproducible_and_seeds_differ() -> None:
    assert arrival_offsets(50, 3.0, seed=1) == arrival_offsets(50, 3.0, seed=1)
    assert arrival_offsets(50, 3.0, seed=1) != arrival_offsets(50, 3.0, seed=2)


def test_infinite_rate_and_uniform_arrivals() -> None:
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_offsets(0, 2.0) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"request_rate": 0.0}, "request_rate"), ({"burstiness": -1.0}, "burstiness")],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, float], field: str) -> None:
    args = {"num_requests": 3, "request_rate": 1.0, "burstiness": 1.0, **kwargs}
    with pytest.raises(ValueError, match=field):
        arrival_offsets(int(args["num_requests"]), args["request_rate"], args["burstiness"])
