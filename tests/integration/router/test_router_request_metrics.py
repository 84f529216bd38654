"""The per-request metrics an operator reads: by model, TTFT of streamed and non-streamed
requests, end-to-end latency, time per output token and tokens, from the usage the client got."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.fake_vllm import FakeVllmServer
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _stream_usage(text: str) -> dict[str, int]:
    """The usage object of the one SSE chunk that carries it."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line.removeprefix("data: "))["usage"]
            if usage:
                assert isinstance(usage, dict)
                return usage
    raise AssertionError("no usage chunk in the stream")


def test_request_metrics_by_model_streamed_and_not(fake: dict[str, FakeVllmServer]) -> None:
    """A streamed request with usage, one without and a non-streamed one: each counted by
    model; TTFT and latency by stream; tokens as the client's usage says; TPOT for the streamed
    one with usage only, and exactly (e2e - TTFT) / (completion_tokens - 1)."""
    body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 5}
    usage_opt = {"stream_options": {"include_usage": True}}
    with running_router(make_settings([fake["p0"].url], [fake["d0"].url])) as router:
        url = f"{router.url}/v1/completions"
        with_usage = httpx.post(url, json={**body, "stream": True, **usage_opt}, timeout=10)
        without = httpx.post(url, json={**body, "stream": True}, timeout=10)
        whole = httpx.post(url, json=body, timeout=10)
        bad = httpx.post(url, json={"model": MODEL}, timeout=10)
        samples = _samples(httpx.get(f"{router.url}/metrics").text)
    assert [r.status_code for r in (with_usage, without, whole, bad)] == [200, 200, 200, 400]
    streamed, answered = _stream_usage(with_usage.text), whole.json()["usage"]
    ok = {"mode": "push", "endpoint": "completions", "model": MODEL, "outcome": "ok"}
    assert _value(samples, "disagg_router_requests_total", **ok) == 3.0
    refused = {**ok, "model": "", "outcome": "invalid_request"}
    assert _value(samples, "disagg_router_requests_total", **refused) == 1.0
    for flag, count in (("true", 2.0), ("false", 1.0)):
        ttft = {"mode": "push", "model": MODEL, "stream": flag}
        assert _value(samples, "disagg_router_ttft_seconds_count", **ttft) == count
        e2e = {"model": MODEL, "stream": flag}
        assert _value(samples, "disagg_router_request_duration_seconds_count", **e2e) == count
    for kind in ("prompt", "completion"):
        expected = streamed[f"{kind}_tokens"] + answered[f"{kind}_tokens"]
        assert _value(samples, f"disagg_router_{kind}_tokens_total", model=MODEL) == expected
    assert streamed["completion_tokens"] == 5
    assert _value(samples, "disagg_router_time_per_output_token_seconds_count", model=MODEL) == 1


def test_tpot_is_the_time_after_the_first_token_per_later_token(
    fake: dict[str, FakeVllmServer],
) -> None:
    """One streamed request: its TPOT is its latency less its TTFT over completion_tokens - 1
    (the three histograms' sums hold one observation each)."""
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with running_router(make_settings([fake["p0"].url], [fake["d0"].url])) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        samples = _samples(httpx.get(f"{router.url}/metrics").text)
    assert resp.status_code == 200
    ttft = _value(
        samples, "disagg_router_ttft_seconds_sum", mode="push", model=MODEL, stream="true"
    )
    e2e = _value(samples, "disagg_router_request_duration_seconds_sum", model=MODEL, stream="true")
    tpot = _value(samples, "disagg_router_time_per_output_token_seconds_sum", model=MODEL)
    assert 0 < ttft <= e2e
    assert tpot == pytest.approx((e2e - ttft) / 3)
