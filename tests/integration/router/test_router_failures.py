"""Failures, timeouts, retries and disconnects: clean errors, no hangs, no stranded legs."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

from devstack.fake_vllm import FakeBehavior, FakeVllmServer, FakeVllmState
from devstack.ports import free_port
from devstack.sse_client import iter_data
from tests.integration.router.router_fixtures import (
    MODEL,
    make_settings,
    running_router,
    sse_payloads,
)

STREAM = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}


def _settings(p: FakeVllmServer, d: FakeVllmServer, **extra: object):  # type: ignore[no-untyped-def]
    ident = p.state.identity
    identities = {p.url: {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port}}
    return make_settings([p.url], [d.url], identities=identities, **extra)


def _idle(*servers: FakeVllmServer) -> bool:
    return all(s.state.wait_for(lambda st: st.in_flight == 0, timeout=5) for s in servers)


def test_prefill_error_before_first_token_cancels_decode(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(prefill_delay_s=0.2, fail_status=500)
    d.state.behavior = FakeBehavior(prefill_delay_s=10)  # D waits for KV that never comes
    with running_router(_settings(p, d)) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 502
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "prefill" in err["message"]


def test_prefill_timeout_cancels_both_legs(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(hang=True)
    d.state.behavior = FakeBehavior(prefill_delay_s=10)
    settings = _settings(p, d, timeouts={"prefill": 0.5, "first_token": 5, "total": 10})
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        assert p.state.wait_for(lambda s: s.cancelled == 1)
        assert d.state.wait_for(lambda s: s.cancelled == 1)
    assert resp.status_code == 504
    assert "prefill" in resp.json()["error"]["message"]
    assert _idle(p, d)


def test_first_token_timeout(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(hang=True)
    settings = _settings(p, d, timeouts={"first_token": 0.5, "prefill": 5, "total": 10})
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 504
    assert "first token" in resp.json()["error"]["message"]


def test_after_prefill_counts_from_ps_answer_not_from_the_dispatch(
    fake: dict[str, FakeVllmServer],
) -> None:
    """A P slower than ``after_prefill`` does not time the stream out: the bound starts at P's
    answer (D's first token follows it through the fabric)."""
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(prefill_delay_s=1.0)
    timeouts = {"after_prefill": 0.8, "first_token": 20, "prefill": 20, "total": 30}
    with running_router(_settings(p, d, timeouts=timeouts)) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=30)
    assert resp.status_code == 200
    assert sse_payloads(resp.text)[-1] == "[DONE]"


def test_after_prefill_finds_a_d_silent_after_ps_answer(fake: dict[str, FakeVllmServer]) -> None:
    """D hangs: the stream ends ``after_prefill`` after P's answer, long before ``first_token``,
    with a 504 naming D and that bound."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(hang=True)
    timeouts = {"after_prefill": 0.3, "first_token": 60, "prefill": 60, "total": 60}
    with running_router(_settings(p, d, timeouts=timeouts)) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=30)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 504
    message = resp.json()["error"]["message"]
    assert f"decode instance {d.url}" in message and "0.3s of P's answer" in message, message


def test_total_timeout_mid_stream_sends_error_event(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.1)
    settings = _settings(p, d, timeouts={"first_token": 0.5, "total": 0.6, "prefill": 0.5})
    body = {**STREAM, "max_tokens": 100}
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 200
    payloads = sse_payloads(resp.text)
    assert payloads[-1] != "[DONE]"
    last = json.loads(payloads[-1])
    assert last["error"]["type"] == "timeout"
    assert 1 < len(payloads) < 10


def test_decode_drop_mid_stream_sends_one_error_event(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(drop_after_tokens=2)
    with running_router(_settings(p, d)) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
    assert resp.status_code == 200
    payloads = sse_payloads(resp.text)
    assert len(payloads) == 3
    assert [json.loads(x)["choices"][0]["text"] for x in payloads[:2]] == [" tok0", " tok1"]
    err = json.loads(payloads[2])["error"]
    assert "decode" in err["message"]
    assert "[DONE]" not in payloads


def test_decode_http_error_before_first_token_cancels_prefill(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(prefill_delay_s=10)
    d.state.behavior = FakeBehavior(fail_status=500)
    with running_router(_settings(p, d)) as router:
        for body in (STREAM, {**STREAM, "stream": False}):
            p.state.reset(p.state.behavior)
            resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
            assert resp.status_code == 502
            assert "decode" in resp.json()["error"]["message"]
            # D fails at once, so the router may cancel the P leg before P has read it; either
            # way P must end with no leg in flight or completed: each one it saw was cancelled.
            assert p.state.wait_for(_prefill_leg_cancelled), _counts(p)


def _prefill_leg_cancelled(state: FakeVllmState) -> bool:
    return state.in_flight == 0 and state.completed == 0 and state.cancelled == len(state.requests)


def _counts(server: FakeVllmServer) -> dict[str, int]:
    s = server.state
    seen = len(s.requests)
    return {
        "seen": seen,
        "cancelled": s.cancelled,
        "completed": s.completed,
        "in_flight": s.in_flight,
    }


def test_non_stream_total_timeout(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.2)
    settings = _settings(p, d, timeouts={"first_token": 0.5, "prefill": 0.5, "total": 0.8})
    with running_router(settings) as router:
        resp = httpx.post(
            f"{router.url}/v1/completions", json={**STREAM, "stream": False, "max_tokens": 50}
        )
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "timeout"


def test_chat_stream_drop_sends_error_event(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(drop_after_tokens=1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    with running_router(_settings(p, d)) as router:
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
    assert resp.status_code == 200
    payloads = [json.loads(x) for x in sse_payloads(resp.text)]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[1]["choices"][0]["delta"]["content"] == " tok0"
    assert set(payloads[2]) == {"error"}
    assert len(payloads) == 3


def test_decode_client_error_is_passed_through(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(fail_status=400)
    with running_router(_settings(p, d)) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].endswith("injected failure")


def test_unreachable_decode_gives_503(fake: dict[str, FakeVllmServer]) -> None:
    p = fake["p0"]
    ident = p.state.identity
    settings = make_settings(
        [p.url],
        [f"http://127.0.0.1:{free_port()}"],
        identities={p.url: {"engine_id": ident.engine_id, "host": ident.host, "port": 1}},
    )
    with running_router(settings) as router:
        ready = httpx.get(f"{router.url}/ready")
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
    assert ready.status_code == 503
    assert ready.json()["decode"] == []
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "service_unavailable"


def test_retry_once_on_a_fresh_pair(fake: dict[str, FakeVllmServer]) -> None:
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url], retry_on_fresh_pair=True)
    with running_router(settings) as router:
        p0.state.reset(FakeBehavior(fail_status=500, fail_times=1))
        p1.state.reset()
        d.state.behavior = FakeBehavior(prefill_delay_s=0.3)
        # round robin starts at p0, which fails once; the retry must go to p1.
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        metrics = httpx.get(f"{router.url}/metrics").text
    assert resp.status_code == 200, resp.text
    assert sse_payloads(resp.text)[-1] == "[DONE]"
    [p0_leg] = p0.state.generation_requests()
    [p1_leg] = p1.state.generation_requests()
    d_legs = d.state.generation_requests()
    assert len(d_legs) == 2
    assert d_legs[0].headers["x-request-id"] == p0_leg.headers["x-request-id"]
    assert d_legs[1].headers["x-request-id"] == p1_leg.headers["x-request-id"]
    assert p0_leg.headers["x-request-id"] != p1_leg.headers["x-request-id"]
    assert d_legs[1].body["kv_transfer_params"]["remote_engine_id"] == "engine-p1"
    assert d_legs[0].outcome == "cancelled"
    assert "disagg_router_retries_total 1.0" in metrics


def test_no_retry_without_flag(fake: dict[str, FakeVllmServer]) -> None:
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    settings = make_settings([p0.url, p1.url], [d.url], retry_on_fresh_pair=False)
    with running_router(settings) as router:
        p0.state.reset(FakeBehavior(fail_status=500))
        p1.state.reset()
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
    assert resp.status_code == 502
    assert p1.state.generation_requests() == []


def test_client_disconnect_mid_stream_cancels_decode(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(token_delay_s=0.05)
    body = {**STREAM, "max_tokens": 500}
    with running_router(_settings(p, d)) as router:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=10) as resp:
            got: list[str] = []
            for data in iter_data(resp):
                got.append(data)
                if len(got) == 2:
                    break
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
        metrics = httpx.get(f"{router.url}/metrics").text
    assert p.state.in_flight == 0
    assert 'outcome="client_disconnected"' in metrics


def test_client_disconnect_before_first_token_cancels_both(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(prefill_delay_s=10)
    d.state.behavior = FakeBehavior(prefill_delay_s=10)
    with running_router(_settings(p, d)) as router:
        for stream in (True, False):
            p.state.reset(p.state.behavior)
            d.state.reset(d.state.behavior)
            errors: list[Exception] = []

            def call(stream: bool = stream, errors: list[Exception] = errors) -> None:
                try:
                    httpx.post(
                        f"{router.url}/v1/completions",
                        json={**STREAM, "stream": stream},
                        timeout=0.5,
                    )
                except httpx.TimeoutException as exc:
                    errors.append(exc)

            t = threading.Thread(target=call)
            t.start()
            assert p.state.wait_for(lambda s: s.in_flight == 1)
            assert d.state.wait_for(lambda s: s.in_flight == 1)
            t.join()
            assert errors
            assert p.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
            assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)


def test_misconfigured_static_identity_is_reported(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    identities = {p.url: {"engine_id": "not-p0", "host": "127.0.0.1", "port": 5600}}
    settings = make_settings([p.url], [d.url], identities=identities)
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=30)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
    assert resp.status_code == 502
    assert "configured engine_id not-p0" in resp.json()["error"]["message"]


def _metric_value(url: str, line_start: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_ready_while_decode_alone_serves_a_model_whose_prefill_pool_is_gone(
    fake: dict[str, FakeVllmServer],
) -> None:
    """No usable P and the default ``when_no_prefill: decode_only``: requests are served by D
    alone, so /ready answers 200 (a readiness probe must not take the replica out now) and says
    the model is degraded, in its body and in the metrics."""
    d = fake["d0"]
    settings = make_settings([f"http://127.0.0.1:{free_port()}"], [d.url])
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        ready = httpx.get(f"{router.url}/ready")
        up = _metric_value(router.url, "disagg_router_ready")
        degraded = _metric_value(router.url, f'disagg_router_model_degraded{{model="{MODEL}"}}')
    assert resp.status_code == 200
    assert ready.status_code == 200, ready.text
    body = ready.json()
    assert body["ready"] is True and body["prefill"] == []
    assert body["models"][MODEL]["state"] == "degraded"
    assert any(MODEL in reason for reason in body["degraded"])
    assert up == 1 and degraded == 1


def test_no_retry_is_logged_or_counted_without_a_fresh_pair(
    fake: dict[str, FakeVllmServer], caplog: pytest.LogCaptureFixture
) -> None:
    """One P that hangs: the retry finds no other P, so the client gets the first failure and
    no retry is logged or counted (none happened)."""
    p, d = fake["p0"], fake["d0"]
    settings = _settings(p, d, timeouts={"prefill": 0.3, "first_token": 5, "total": 10})
    with (
        caplog.at_level(logging.INFO, logger="disagg_router.router"),
        running_router(settings) as router,
    ):
        p.state.behavior = FakeBehavior(hang=True)
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        metrics = httpx.get(f"{router.url}/metrics").text
    assert resp.status_code == 504
    assert "disagg_router_retries_total 0.0" in metrics
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_a_retry_keeps_the_first_attempts_total_deadline(fake: dict[str, FakeVllmServer]) -> None:
    """p0 hangs until its 2 s prefill timeout, the retry on p1 has 0.5 s of the 2.5 s total left:
    D's first token (1 s after its leg starts) comes too late for the request; with a deadline
    restarted by the retry it would have come in time."""
    p0, p1, d = fake["p0"], fake["p1"], fake["d0"]
    timeouts = {"prefill": 2.0, "first_token": 2.0, "total": 2.5}
    settings = make_settings([p0.url, p1.url], [d.url], timeouts=timeouts)
    with running_router(settings) as router:
        p0.state.behavior = FakeBehavior(hang=True)
        d.state.behavior = FakeBehavior(prefill_delay_s=1.0)
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        assert d.state.wait_for(lambda s: s.in_flight == 0)
        retries = httpx.get(f"{router.url}/metrics").text
    assert "disagg_router_retries_total 1.0" in retries
    assert resp.status_code == 504, resp.text
    assert "first token" in resp.json()["error"]["message"]


def test_decode_stalled_mid_stream_ends_with_one_error_event(
    fake: dict[str, FakeVllmServer],
) -> None:
    """D sends 2 tokens, then nothing: after ``timeouts.inter_token`` the client gets one SSE
    error event, D's leg is cancelled, the stall is counted."""
    p, d = fake["p0"], fake["d0"]
    d.state.behavior = FakeBehavior(stall_after_tokens=2)
    settings = _settings(p, d, timeouts={"inter_token": 0.3})
    with running_router(settings) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        assert d.state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)
        metrics = httpx.get(f"{router.url}/metrics").text
    assert resp.status_code == 200
    payloads = sse_payloads(resp.text)
    assert [json.loads(x)["choices"][0]["text"] for x in payloads[:2]] == [" tok0", " tok1"]
    assert len(payloads) == 3
    err = json.loads(payloads[2])["error"]
    assert err["type"] == "timeout" and "inter_token" in err["message"], err
    assert d.url in err["message"]
    assert "disagg_router_stream_stalls_total 1.0" in metrics


def test_a_decode_that_keeps_stalling_leaves_rotation(fake: dict[str, FakeVllmServer]) -> None:
    """Each stall counts against D's breaker (its first tokens do not reset the count): after
    ``failure_threshold`` stalled streams D is out, d1 serves."""
    p, d0, d1 = fake["p0"], fake["d0"], fake["d1"]
    ident = p.state.identity
    identities = {p.url: {"engine_id": ident.engine_id, "host": ident.host, "port": ident.port}}
    settings = make_settings(
        [p.url],
        [d0.url, d1.url],
        identities=identities,
        timeouts={"inter_token": 0.3},
        breaker={"failure_threshold": 2, "backoff": 3600, "max_backoff": 3600},
        retry_on_fresh_pair=False,
    )
    with running_router(settings) as router:
        d0.state.behavior = FakeBehavior(stall_after_tokens=1)
        for _ in range(4):  # round robin: d0 (stalls), d1, d0 (stalls: out), d1
            httpx.post(f"{router.url}/v1/completions", json=STREAM, timeout=10)
        ready = httpx.get(f"{router.url}/ready").json()
    assert ready["decode"] == [d1.url]
    assert ready["missing"][f"decode {d0.url}"].startswith("breaker open")
