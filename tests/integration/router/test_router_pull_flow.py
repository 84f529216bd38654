"""Pull mode (stock NixlConnector): P first, then D with exactly what P returned."""

from __future__ import annotations

import httpx

from devstack.fake_vllm import FakeBehavior, FakeVllmServer
from tests.integration.router.router_fixtures import (
    MODEL,
    make_settings,
    running_router,
    sse_payloads,
    sse_text,
)


def test_pull_runs_prefill_then_decode_with_its_kv_params(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.transfer_mode = "pull"
    p.state.behavior.prefill_delay_s = 0.2
    body = {"model": MODEL, "prompt": "x y", "max_tokens": 3, "stream": True}
    with running_router(make_settings([p.url], [d.url], mode="pull")) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        chat = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
    assert resp.status_code == 200
    assert sse_text(resp.text, chat=False) == " tok0 tok1 tok2"
    assert sse_payloads(resp.text)[-1] == "[DONE]"
    assert chat.status_code == 200
    assert chat.json()["choices"][0]["message"]["content"].startswith(" tok0")
    # No identity probe in pull mode: only the two prefill legs reached P.
    p_legs, d_legs = p.state.generation_requests(), d.state.generation_requests()
    assert [r.path for r in p_legs] == ["/v1/completions", "/v1/chat/completions"]
    for p_leg, d_leg in zip(p_legs, d_legs, strict=True):
        assert p_leg.finished_at is not None
        assert d_leg.received_at >= p_leg.finished_at  # sequential, not overlapped
        rid = p_leg.headers["x-request-id"]
        assert d_leg.headers["x-request-id"] == rid
        kv = d_leg.body["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True
        assert kv["remote_engine_id"] == "engine-p0"
        assert kv["transfer_mode"] == "pull"
        assert kv["remote_block_ids"] == [[1]]
        assert kv["transfer_id"] == rid
        assert kv["remote_request_id"].startswith(("cmpl-" + rid, "chatcmpl-" + rid))


def test_pull_prefill_failure_never_starts_decode(fake: dict[str, FakeVllmServer]) -> None:
    p, d = fake["p0"], fake["d0"]
    p.state.behavior = FakeBehavior(fail_status=503)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with running_router(make_settings([p.url], [d.url], mode="pull")) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 502
    assert "prefill" in resp.json()["error"]["message"]
    assert d.state.generation_requests() == []


def test_pull_prefill_without_kv_params_is_an_error(fake: dict[str, FakeVllmServer]) -> None:
    """A P started without a KV connector answers without kv_transfer_params."""
    p, d = fake["d1"], fake["d0"]
    p.state.kv_connector = False
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with running_router(make_settings([p.url], [d.url], mode="pull")) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 502
    assert "kv_transfer_params" in resp.json()["error"]["message"]
    assert d.state.generation_requests() == []
