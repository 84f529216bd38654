"""Metric definitions against hand-computed values (no timing involved)."""

from __future__ import annotations

import pytest

from bench.metrics import RequestRecord, compute_metrics, counted_ttft, percentile
from bench.results import counted_ttft_to_dict


def test_percentile_matches_linear_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    # rank = 3 * 0.9 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_metrics_hand_computed() -> None:
    # Request A: TTFT 0.1 s, tokens at 0.1, 0.3, 0.6 -> ITL 0.2, 0.3; E2EL 0.6; TPOT 0.25.
    a = RequestRecord(True, 10, 3, start_time=0.0, ttft=0.1, latency=0.6, itl=(0.2, 0.3))
    # Request B: TTFT 0.3 s, tokens at 0.3, 0.4 -> ITL 0.1; E2EL 0.4; TPOT 0.1.
    b = RequestRecord(True, 20, 2, start_time=0.5, ttft=0.3, latency=0.4, itl=(0.1,))
    # Request C: one token only: counts for TTFT/E2EL, not for TPOT.
    c = RequestRecord(True, 30, 1, start_time=1.0, ttft=0.2, latency=0.2)
    failed = RequestRecord(False, 40, 0, start_time=1.0, ttft=0.0, latency=0.0, error="boom")
    m = compute_metrics([a, b, c, failed], duration_s=2.0, percentiles=(50.0, 99.0))

    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60
    assert m.total_output_tokens == 6
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(33.0)
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    # TTFT sorted 0.1 0.2 0.3: p99 rank 1.98 -> 0.2 + 0.98 * 0.1
    assert m.ttft.percentile(99) == pytest.approx(298.0)
    assert m.tpot.mean_ms == pytest.approx(175.0)
    assert m.tpot.median_ms == pytest.approx(175.0)
    assert m.itl.mean_ms == pytest.approx(200.0)
    assert m.itl.median_ms == pytest.approx(200.0)
    assert m.e2el.mean_ms == pytest.approx(400.0)
    assert m.e2el.std_ms == pytest.approx(163.29931618554522)


def test_metrics_all_failed_is_zero_not_error() -> None:
    failed = RequestRecord(False, 5, 0, 0.0, 0.0, 0.0, error="x")
    m = compute_metrics([failed], duration_s=1.0)
    assert m.completed == 0 and m.failed == 1
    assert m.ttft.mean_ms == 0.0 and m.request_throughput == 0.0


def test_metrics_rejects_non_positive_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([], duration_s=0.0)


def test_failed_requests_count_at_the_limit() -> None:
    ok = RequestRecord(True, 10, 4, 0.0, 1.0, 2.0)
    cut = RequestRecord(False, 10, 0, 0.0, 0.0, 0.0, (), "time limit of 30 s for the run reached")
    dist = counted_ttft([ok, ok, cut], limit_s=30.0)
    assert dist.mean_ms == pytest.approx(1000 * 32 / 3)
    assert dist.percentile(50.0) == pytest.approx(1000.0)
    # the completed-only statistics would say 1 s: the counted ones never drop the failure
    assert compute_metrics([ok, ok, cut], 10.0).ttft.mean_ms == pytest.approx(1000.0)
    as_dict = counted_ttft_to_dict([ok, ok, cut], 30.0)
    assert as_dict["goodput"] == pytest.approx(2 / 3)
    assert as_dict["p99_ttft_counted_ms"] == pytest.approx(dist.percentile(99.0))
