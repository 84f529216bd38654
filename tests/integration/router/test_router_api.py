"""Router API surface: malformed input, auth, models, health/ready, metrics."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from devstack.fake_vllm import FakeVllmServer, UvicornThread
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router
from tests.support.wait import wait_until

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def router(fakes: dict[str, FakeVllmServer]) -> Iterator[UvicornThread]:
    """One router for the module (its tests only add requests, they never steer the fakes)."""
    settings = make_settings([fakes["p0"].url], [fakes["d0"].url], api_keys=[KEY])
    with running_router(settings) as server:
        yield server


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"model": "fake-model"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": {"a": 1}}', 400, "prompt"),
        ("/v1/completions", b'{"model": "fake-model", "prompt": ["a", "b"]}', 400, "prompt"),
        (
            "/v1/completions",
            b'{"model": "fake-model", "prompt": "x", "stream": "yes"}',
            400,
            "stream",
        ),
        (
            "/v1/completions",
            b'{"model": "fake-model", "prompt": "x", "max_tokens": "5"}',
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            b'{"model": "fake-model", "prompt": "x", "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "x", "n": 2}', 400, "n"),
        ("/v1/chat/completions", b'{"model": "fake-model"}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "fake-model", "messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "fake-model", "messages": [1]}', 400, "messages.0"),
        (
            "/v1/chat/completions",
            b'{"model": "fake-model", "messages": [{"role": "user"}], "max_completion_tokens": -1}',
            400,
            "max_completion_tokens",
        ),
    ],
)
def test_malformed_input_gets_4xx_naming_the_field(
    router: UvicornThread,
    fake: dict[str, FakeVllmServer],
    path: str,
    body: bytes,
    status: int,
    param: str | None,
) -> None:
    p_before = len(fake["p0"].state.generation_requests())
    d_before = len(fake["d0"].state.generation_requests())
    resp = httpx.post(
        router.url + path,
        content=body,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert len(fake["p0"].state.generation_requests()) == p_before
    assert len(fake["d0"].state.generation_requests()) == d_before


def test_api_key_required_on_v1_only(router: UvicornThread) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    missing = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
    wrong = httpx.post(
        f"{router.url}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer nope"},
        timeout=10,
    )
    ok = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=10)
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert ok.status_code == 200
    assert httpx.get(f"{router.url}/v1/models").status_code == 401
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert httpx.get(f"{router.url}/ready").status_code == 200


def test_models_ready_and_unknown_routes(router: UvicornThread) -> None:
    models = httpx.get(f"{router.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    ready = httpx.get(f"{router.url}/ready").json()
    assert ready["ready"] is True
    assert len(ready["prefill"]) == len(ready["decode"]) == 1
    missing = httpx.get(f"{router.url}/v1/nothing")
    assert missing.status_code == 404
    assert "error" in missing.json()
    wrong_method = httpx.get(f"{router.url}/v1/completions", headers=AUTH)
    assert wrong_method.status_code == 405


def test_metrics_count_requests_and_latencies(fake: dict[str, FakeVllmServer]) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    with running_router(make_settings([fake["p0"].url], [fake["d0"].url])) as router:
        assert httpx.post(f"{router.url}/v1/completions", json=body).is_success
        bad = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL})
        assert bad.status_code == 400
        text = httpx.get(f"{router.url}/metrics").text
    ok = f'endpoint="completions",mode="push",model="{MODEL}",outcome="ok"'
    assert f"disagg_router_requests_total{{{ok}}} 1.0" in text
    assert 'outcome="invalid_request"} 1.0' in text
    assert (
        f'disagg_router_ttft_seconds_count{{mode="push",model="{MODEL}",stream="true"}} 1.0' in text
    )
    assert "disagg_router_prefill_leg_seconds_count" in text
    assert "disagg_router_decode_first_token_seconds_count" in text
    assert 'disagg_router_backend_in_flight{backend="' in text
    assert 'disagg_router_backend_healthy{backend="' in text


def test_unready_without_a_prefill_identity(fake: dict[str, FakeVllmServer]) -> None:
    """Push mode, P has no configured identity and its identity probe fails: not ready, and
    with ``when_no_prefill: fail`` requests are refused (by default D would serve them alone)."""
    p, d = fake["d1"], fake["d0"]
    p.state.kv_connector = False  # a "P" that returns no kv_transfer_params
    settings = make_settings([p.url], [d.url], disaggregation={"when_no_prefill": "fail"})
    with running_router(settings) as server:
        ready = httpx.get(f"{server.url}/ready")
        resp = httpx.post(
            f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10
        )
    assert ready.status_code == 503
    assert ready.json()["prefill"] == []
    assert resp.status_code == 503


def test_backend_starting_late_joins_without_waiting_a_full_interval(
    fake: dict[str, FakeVllmServer],
) -> None:
    p = fake["p0"]
    late = FakeVllmServer()  # port reserved, not serving yet: connections are refused
    settings = make_settings(
        [p.url], [late.url], health={"interval": 3600, "unhealthy_interval": 0.1}
    )
    with running_router(settings) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 503
        with late:
            wait_until(
                lambda: httpx.get(f"{server.url}/ready").status_code == 200,
                what="the late decode makes the router ready",
            )
            resp = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                timeout=10,
            )
    assert resp.status_code == 200, resp.text
