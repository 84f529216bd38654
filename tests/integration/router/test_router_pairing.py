"""Pairing by engine shape over real loopback HTTP: the fakes answer identity probes with a
shape like our connector; the router skips the pair the connector cannot serve, says why in
``/ready`` and ``/metrics``, and answers 503 naming the reason only when no pair is served."""

from __future__ import annotations

from typing import Any

import httpx

from devstack.fake_vllm import FakeVllmServer
from disagg_router.connector.contract import IDENTITY_PROBE_KEY, EngineShape
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router
from tests.support.wait import wait_until

TP1, TP2, TP3 = (EngineShape(tp, 1, 16, num_kv_heads=8) for tp in (1, 2, 3))
BODY = {"model": MODEL, "prompt": "one two three", "max_tokens": 2}


def _ready(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/ready", timeout=5).json()
    return body


def _legs(server: FakeVllmServer) -> list[Any]:
    """The real legs a fake served (identity probes left out)."""
    return [
        r
        for r in server.state.generation_requests()
        if not (r.body.get("kv_transfer_params") or {}).get(IDENTITY_PROBE_KEY)
    ]


def test_a_tp_incompatible_pair_is_skipped_and_ready_says_why(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d0, d1 = fake["p0"], fake["d0"], fake["d1"]
    p.state.shape, d0.state.shape, d1.state.shape = TP2, TP3, TP1
    settings = make_settings([p.url], [d0.url, d1.url])  # P's identity is probed
    with running_router(settings) as router:
        refused = wait_until(lambda: _ready(router.url)["refused_pairs"], what="a refused pair")
        for _ in range(4):  # round robin would give d0 every other request
            resp = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)
            assert resp.status_code == 200, resp.text
        ready = _ready(router.url)
        metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    reason = "P tp_size=2 and D tp_size=3: neither divides the other"
    assert refused == [{"model": MODEL, "prefill": p.url, "decode": d0.url, "reason": reason}]
    assert ready["ready"] is True and ready["models"][MODEL]["state"] == "ready"
    assert any(reason in line for line in ready["degraded"])
    assert f'disagg_router_refused_pairs{{model="{MODEL}"}} 1.0' in metrics
    assert _legs(d0) == [] and len(_legs(d1)) == 4
    # D was asked for its shape by a bare identity probe (no leg).
    probe = next(r for r in d0.state.generation_requests() if r not in _legs(d0))
    assert probe.body["kv_transfer_params"] == {IDENTITY_PROBE_KEY: True}


def test_no_served_pair_answers_503_naming_the_reason(fake: dict[str, FakeVllmServer]) -> None:
    p, d0 = fake["p0"], fake["d0"]
    p.state.shape, d0.state.shape = TP2, TP3
    with running_router(make_settings([p.url], [d0.url])) as router:
        wait_until(lambda: _ready(router.url)["refused_pairs"], what="a refused pair")
        resp = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)
        ready = httpx.get(f"{router.url}/ready", timeout=5)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "P tp_size=2 and D tp_size=3: neither divides the other" in error["message"]
    assert _legs(p) == [] and _legs(d0) == []
    assert ready.status_code == 503 and ready.json()["models"][MODEL]["state"] == "unavailable"


def test_without_shapes_every_pair_is_served_and_no_d_is_probed(
    fake: dict[str, FakeVllmServer],
) -> None:
    p, d0 = fake["p0"], fake["d0"]  # fakes answer no shape by default, like vLLM's NIXL
    with running_router(make_settings([p.url], [d0.url])) as router:
        resp = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=10)
        ready = _ready(router.url)
    assert resp.status_code == 200
    assert ready["refused_pairs"] == []
    assert d0.state.generation_requests() == _legs(d0)  # no identity probe reached D
