"""Admission control, circuit breaking, request ids and JSON request logs against fake vLLM
instances on real loopback HTTP."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from disagg_router.router.observability.reqlog import JsonFormatter
from tests.integration.router.router_fixtures import (
    MODEL,
    make_settings,
    running_router,
    sse_payloads,
)
from tests.support.wait import wait_until

LONG = {"model": MODEL, "prompt": "a b c", "max_tokens": 2000, "stream": True}
SHORT = {"model": MODEL, "prompt": "a b c", "max_tokens": 3}


def _metric(url: str, name: str, having: str = "") -> float:
    """Sum of the samples of ``name`` (whose labels contain ``having``) on the router's
    /metrics; 0 when absent."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")) and having in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextmanager
def _held_stream(url: str) -> Iterator[None]:
    """A long stream through the router, open (first token read) until the block ends."""
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        yield


def _admission(**admission: Any) -> dict[str, Any]:
    return {"admission": {"max_in_flight": 1, **admission}, "health": {"interval": 3600}}


def test_full_instance_without_queue_answers_429_with_retry_after(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    settings = make_settings([p.url], [d.url], **_admission(queue_size=0, retry_after=3))
    with running_router(settings) as router, _held_stream(router.url):
        before = len(d.state.generation_requests())
        resp = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
        rejected = _metric(router.url, "disagg_router_admission_rejected_total")
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    assert resp.headers["x-request-id"]
    err = resp.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded"
    assert len(d.state.generation_requests()) == before  # the refused request reached no D
    assert rejected >= 1


def test_queued_request_gets_the_slot_when_the_holder_ends(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    settings = make_settings([p.url], [d.url], **_admission(queue_size=1, max_wait=30))
    result: dict[str, httpx.Response] = {}
    with running_router(settings) as router:
        url = router.url
        with _held_stream(url):
            waiter = threading.Thread(
                target=lambda: result.setdefault(
                    "r", httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
                )
            )
            waiter.start()
            wait_until(
                lambda: _metric(url, "disagg_router_admission_queue_length") == 1,
                10,
                "the second request to queue for D",
            )
        waiter.join(30)
        waited = _metric(url, "disagg_router_admission_wait_seconds_count")
    assert result["r"].status_code == 200, result["r"].text
    assert waited >= 2


def test_wait_for_a_slot_is_bounded(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    settings = make_settings([p.url], [d.url], **_admission(queue_size=4, max_wait=0.2))
    with running_router(settings) as router, _held_stream(router.url):
        resp = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
    assert resp.status_code == 429
    assert "within 0.2s" in resp.json()["error"]["message"]


def _breaker(**extra: Any) -> dict[str, Any]:
    return {
        "breaker": {"failure_threshold": 2, "backoff": 0.2, "max_backoff": 1},
        "health": {"interval": 3600, "unhealthy_interval": 3600},
        **extra,
    }


def test_failing_prefill_is_taken_out_then_brought_back_by_a_half_open_probe(
    fake: dict[str, FakeVllmServer],
) -> None:
    """p0 answers 500 (its /health stays fine): after 2 failed legs its breaker opens and every
    request goes to p1 (each failure retried there, so clients see 200); once p0 recovers, the
    half-open probe puts it back."""
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url], **_breaker())
    with running_router(settings) as router:
        p0.state.behavior = FakeBehavior(fail_status=500)
        statuses = [
            httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10).status_code
            for _ in range(6)
        ]
        ready = httpx.get(f"{router.url}/ready").json()
        assert _metric(router.url, "disagg_router_backend_breaker_open") == 1
        p0_legs = [r for r in p0.state.generation_requests() if r.body["prompt"] == "a b c"]
        p0.state.behavior = FakeBehavior()
        wait_until(
            lambda: p0.url in httpx.get(f"{router.url}/ready").json()["prefill"],
            10,
            "p0 back in rotation",
        )
        probes_ok = _metric(router.url, "disagg_router_breaker_probes_total", 'outcome="ok"')
        after = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
    assert statuses == [200] * 6
    assert len(p0_legs) == 2  # the breaker opened after the threshold; no more traffic to p0
    assert ready["prefill"] == [p1.url]
    # Out by its breaker: open, or half-open if a probe (which still failed) ran at that moment.
    assert re.match(r"breaker (open|half_open): ", ready["missing"][f"prefill {p0.url}"])
    assert probes_ok >= 1
    assert after.status_code == 200


def test_retry_never_re_picks_the_instance_that_failed(fake: dict[str, FakeVllmServer]) -> None:
    """One P that fails: the retry finds no other P and the client gets the first failure; the
    failed P saw one leg only."""
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], **_breaker())
    with running_router(settings) as router:
        p.state.behavior = FakeBehavior(fail_status=503)
        resp = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
    assert resp.status_code == 502
    assert p.url in resp.json()["error"]["message"]
    assert len([r for r in p.state.generation_requests() if r.body["prompt"] == "a b c"]) == 1


def test_request_ids_and_json_summary_log(
    fake: dict[str, FakeVllmServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Every response carries X-Request-Id (the legs' id when dispatched); a safe client id is
    logged but never sent to vLLM; an unsafe one is ignored; the summary record has the fields."""
    p, d = fake["p0"], fake["d0"]
    settings = make_settings([p.url], [d.url], health={"interval": 3600})
    with (
        caplog.at_level(logging.INFO, logger="disagg_router.router.requests"),
        running_router(settings) as r,
    ):
        ok = httpx.post(
            f"{r.url}/v1/completions", json=SHORT, headers={"X-Request-Id": "client-42"}
        )
        stream = httpx.post(f"{r.url}/v1/completions", json={**SHORT, "stream": True})
        bad = httpx.post(
            f"{r.url}/v1/completions", content=b"{", headers={"X-Request-Id": "evil\tid"}
        )
        missing = httpx.get(f"{r.url}/nope")
    d_legs = [x for x in d.state.generation_requests() if x.body["prompt"] == "a b c"]
    assert ok.status_code == 200 and sse_payloads(stream.text)[-1] == "[DONE]"
    assert ok.headers["x-request-id"] == d_legs[0].headers["x-request-id"] != "client-42"
    assert stream.headers["x-request-id"] == d_legs[1].headers["x-request-id"]
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
    assert missing.status_code == 404 and missing.headers["x-request-id"]
    summaries = [rec for rec in caplog.records if rec.name == "disagg_router.router.requests"]
    first = json.loads(JsonFormatter().format(summaries[0]))
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["client_request_id"] == "client-42"
    assert first["model"] == MODEL and first["outcome"] == "ok" and first["status"] == 200
    assert first["prefill"] == p.url and first["decode"] == d.url
    assert set(first["timings"]) == {"admitted", "prefill_done", "first_token"}
    rejected = json.loads(JsonFormatter().format(summaries[-1]))
    assert rejected["status"] == 400 and rejected["client_request_id"] is None


def _prefill_legs(p: FakeVllmServer) -> int:
    """Real P legs p received (identity probes excluded)."""
    return len([r for r in p.state.generation_requests() if r.body["prompt"] == "a b c"])


def test_prefill_passing_probes_but_failing_legs_gets_one_trial_leg_per_passed_probe(
    fake: dict[str, FakeVllmServer],
) -> None:
    """p0 passes /health and every identity probe but answers its legs 500, without retries:
    after its breaker opened, a passed half-open probe lets one real leg try it (it fails, the
    breaker opens again with a longer backoff); the requests after it are served by D alone."""
    p0, d = fake["p0"], fake["d0"]
    # After the failed trial leg the next probe is 3 s away: ample for the checks below.
    breaker = {"failure_threshold": 2, "backoff": 1.5, "max_backoff": 60}
    settings = make_settings(
        [p0.url], [d.url], **_breaker(breaker=breaker, retry_on_fresh_pair=False)
    )
    with running_router(settings) as router:
        p0.state.behavior = FakeBehavior(leg_fail_status=500)

        def post() -> int:
            return httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10).status_code

        opening = [post(), post()]
        wait_until(
            lambda: _metric(router.url, "disagg_router_breaker_probes_total", 'outcome="ok"') >= 1,
            10,
            "a passed half-open probe of p0",
        )
        legs_before = _prefill_legs(p0)
        after_probe = [post(), post(), post()]
        missing = httpx.get(f"{router.url}/ready").json()["missing"]
        gauge = _metric(router.url, "disagg_router_backend_breaker_open")
    assert opening == [502, 502]
    assert after_probe == [502, 200, 200]  # one trial leg, then D alone again
    assert _prefill_legs(p0) - legs_before == 1
    assert re.match(r"breaker (open|half_open): ", missing[f"prefill {p0.url}"])
    assert gauge == 1


def test_breaker_gauge_goes_back_to_zero_once_the_instance_serves_again(
    fake: dict[str, FakeVllmServer],
) -> None:
    p0, d = fake["p0"], fake["d0"]
    settings = make_settings([p0.url], [d.url], **_breaker(retry_on_fresh_pair=False))
    with running_router(settings) as router:
        p0.state.behavior = FakeBehavior(leg_fail_status=500)
        for _ in range(2):
            httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
        opened = _metric(router.url, "disagg_router_backend_breaker_open")
        p0.state.behavior = FakeBehavior()
        wait_until(
            lambda: _metric(router.url, "disagg_router_breaker_probes_total", 'outcome="ok"') >= 1,
            10,
            "a passed half-open probe of p0",
        )
        served = httpx.post(f"{router.url}/v1/completions", json=SHORT, timeout=10)
        closed = _metric(router.url, "disagg_router_backend_breaker_open")
    assert opened == 1
    assert served.status_code == 200 and _prefill_legs(p0) == 3
    assert closed == 0


def test_a_full_decode_is_blamed_and_no_prefill_slot_is_held_while_waiting_for_it(
    fake: dict[str, FakeVllmServer],
) -> None:
    """D is the bottleneck (one slot, held by a stream; one request queued for it): the next
    request gets a 429 naming D, counted against D; P, free all along, is neither held by the
    queued request nor reported at capacity."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.02)
    settings = make_settings([p.url], [d.url], **_admission(queue_size=1, max_wait=10))
    result: dict[str, httpx.Response] = {}
    with running_router(settings) as router:
        url = router.url
        with _held_stream(url):
            queued = threading.Thread(
                target=lambda: result.setdefault(
                    "queued", httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
                )
            )
            queued.start()
            wait_until(
                lambda: _metric(url, "disagg_router_admission_queue_length") == 1,
                10,
                "the second request to queue",
            )
            queue_roles = httpx.get(f"{url}/metrics", timeout=5).text
            third = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
            rejected_d = _metric(url, "disagg_router_admission_rejected_total", 'role="decode"')
            rejected_p = _metric(url, "disagg_router_admission_rejected_total", 'role="prefill"')
        queued.join(30)
    assert f'disagg_router_admission_queue_length{{backend="{d.url}",role="decode"}} 1.0' in (
        queue_roles
    )
    assert third.status_code == 429
    assert d.url in third.json()["error"]["message"]
    assert p.url not in third.json()["error"]["message"]
    assert (rejected_d, rejected_p) == (1, 0)
    assert result["queued"].status_code == 200, result["queued"].text
