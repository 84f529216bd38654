"""A point's TTFT breakdown from two scrapes of real exporters' text: means of the delta."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.breakdown import histogram_means, totals
from disagg_router.router.observability.metrics import RouterMetrics


def test_means_cover_only_the_observations_between_the_scrapes() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    metrics.ttft_stage.labels("prefill").observe(10.0)  # before the point
    before = {"router": totals(metrics.render().decode())}
    for seconds in (0.2, 0.4):
        metrics.ttft_stage.labels("prefill").observe(seconds)
    metrics.ttft_stage.labels("relay_to_client").observe(0.001)
    after = {"router": totals(metrics.render().decode())}
    means = histogram_means(before, after)
    assert means == pytest.approx(
        {
            "router:disagg_router_ttft_stage_seconds{prefill}": 300.0,
            "router:disagg_router_ttft_stage_seconds{relay_to_client}": 1.0,
        }
    )


def test_series_without_a_stage_are_summed_over_their_labels() -> None:
    registry = CollectorRegistry()
    queue = Histogram("vllm:request_queue_time_seconds", "q", ["engine"], registry=registry)
    queue.labels("0").observe(0.1)
    queue.labels("1").observe(0.3)
    other = Histogram("unrelated_seconds", "u", registry=registry)
    other.observe(1.0)
    series = totals(generate_latest(registry).decode())
    assert series == {"vllm:request_queue_time_seconds": pytest.approx((0.4, 2.0))}
    assert histogram_means({}, {"prefill": series}) == pytest.approx(
        {"prefill:vllm:request_queue_time_seconds": 200.0}
    )
