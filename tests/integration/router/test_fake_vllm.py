"""The fake vLLM server behaves like vLLM in P/D mode as far as the router can see."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from devstack.fake_vllm import FakeBehavior, FakeVllmState, PushIdentity, fake_vllm
from tests.integration.router.router_fixtures import sse_payloads


def test_prefill_leg_returns_kv_transfer_params_and_is_recorded() -> None:
    state = FakeVllmState(identity=PushIdentity(engine_id="eng-p0", port=5601, tp_size=2))
    with fake_vllm(state) as srv:
        body = {
            "model": "fake-model",
            "prompt": "a b c",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        resp = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200
    data = resp.json()
    kv = data["kv_transfer_params"]
    assert kv["remote_engine_id"] == "eng-p0"
    assert kv["remote_port"] == 5601
    assert kv["tp_size"] == 2
    assert kv["remote_request_id"].startswith("cmpl-abc-0-")
    assert data["usage"]["prompt_tokens"] == 3
    assert data["usage"]["completion_tokens"] == 1
    [rec] = state.generation_requests()
    assert rec.body == body
    assert rec.headers["x-request-id"] == "abc"
    assert rec.outcome == "ok"


def test_decode_stream_chat_has_role_tokens_usage_and_done() -> None:
    with fake_vllm(FakeVllmState(behavior=FakeBehavior(default_max_tokens=3))) as srv:
        body = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi there"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": {"do_remote_prefill": True},
        }
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
    payloads = sse_payloads(resp.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " tok0 tok1 tok2"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


def test_http_error_and_drop_are_injected() -> None:
    state = FakeVllmState(behavior=FakeBehavior(fail_status=503, fail_times=1))
    with fake_vllm(state) as srv:
        first = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        second = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        state.behavior.fail_times = None
        state.behavior.fail_status = None
        state.behavior.drop_after_tokens = 1
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "stream": True})
    assert first.status_code == 503
    assert "error" in first.json()
    assert second.status_code == 200


def test_leg_failures_spare_health_probes_and_plain_completions() -> None:
    """``leg_fail_status``: real P and D legs fail; /health, identity probes and a plain
    completion (the router's half-open probe of a D) pass."""
    state = FakeVllmState(behavior=FakeBehavior(leg_fail_status=500))

    def post(kv: dict[str, object] | None) -> int:
        body: dict[str, object] = {"model": "fake-model", "prompt": "x", "max_tokens": 1}
        if kv is not None:
            body["kv_transfer_params"] = kv
        return httpx.post(f"{srv.url}/v1/completions", json=body).status_code

    with fake_vllm(state) as srv:
        health = httpx.get(f"{srv.url}/health").status_code
        probe = post({"do_remote_decode": True, "identity_probe": True})
        plain = post(None)
        prefill_leg = post({"do_remote_decode": True})
        decode_leg = post({"do_remote_prefill": True})
    assert (health, probe, plain) == (200, 200, 200)
    assert (prefill_leg, decode_leg) == (500, 500)


def test_hang_counts_in_flight_and_cancellation() -> None:
    state = FakeVllmState(behavior=FakeBehavior(hang=True))
    with fake_vllm(state) as srv:
        errors: list[Exception] = []

        def call() -> None:
            try:
                httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=0.3)
            except httpx.TimeoutException as exc:
                errors.append(exc)

        t = threading.Thread(target=call)
        t.start()
        assert state.wait_for(lambda s: s.in_flight == 1)
        t.join()
        assert errors
        assert state.wait_for(lambda s: s.cancelled == 1 and s.in_flight == 0)


def test_models_health_metrics() -> None:
    with fake_vllm(FakeVllmState(model="m1")) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "m1"
        metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'vllm:num_requests_running{model_name="m1"} 0.0' in metrics
    assert "vllm:num_requests_waiting" in metrics


def test_prefill_slots_queue_requests_and_report_them_waiting() -> None:
    """With one prefill slot the second request waits for the first, and /metrics says so."""
    # the second request must arrive while the first one prefills: 2 s is ample even when loaded
    behavior = FakeBehavior(prefill_delay_s=2.0, prefill_slots=1)
    state = FakeVllmState(behavior=behavior)
    with fake_vllm(state) as srv:
        body = {"model": "fake-model", "prompt": "x", "max_tokens": 1}
        answers: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(
                    httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10).status_code
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        assert state.wait_for(lambda s: s.waiting == 1 and s.in_flight == 2)
        gauges = httpx.get(f"{srv.url}/metrics").text
        # seen waiting: the queued request, once it has the slot, prefills without a delay (the
        # fake reads the delay then), so the test does not wait out a second 2 s
        behavior.prefill_delay_s = 0.0
        for t in threads:
            t.join()
    assert 'vllm:num_requests_waiting{model_name="fake-model"} 1.0' in gauges
    assert 'vllm:num_requests_running{model_name="fake-model"} 1.0' in gauges
    assert answers == [200, 200]
    assert state.waiting == 0
