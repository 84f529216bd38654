"""The app with an injected httpx transport (no upstream servers): leg routing, error mapping."""

from __future__ import annotations

import json
from typing import Any

import httpx

from devstack.fake_vllm import UvicornThread
from router.config import settings_from_mapping
from router.health.monitor import HealthMonitor
from router.http.app import create_app
from router.runtime import Runtime
from tests.unit.router.mock_upstream import KV, D, P, answer


def _settings(mode: str) -> Any:
    """Health re-checks far apart, so a backend taken out stays out during a test."""
    return settings_from_mapping(
        {
            "models": ["m"],
            "mode": mode,
            "prefill": {"instances": [{"url": P}]},
            "decode": {"instances": [{"url": D}]},
            "health": {"interval": 3600, "unhealthy_interval": 3600},
        }
    )


def test_pull_mode_through_a_mock_transport() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        seen.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}", body))
        if body["kv_transfer_params"].get("do_remote_decode"):
            return httpx.Response(200, json=answer("a", KV))
        return httpx.Response(200, json=answer(" decoded", None))

    app = create_app(_settings("pull"), transport=httpx.MockTransport(handler))
    with UvicornThread(app) as server:
        resp = httpx.post(
            f"{server.url}/v1/completions", json={"model": "m", "prompt": "x y z"}, timeout=10
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == " decoded"
    assert [url for url, _ in seen] == [P, D]
    assert seen[1][1]["kv_transfer_params"] == {
        **KV,
        "transfer_id": seen[0][1]["kv_transfer_params"]["transfer_id"],
    }


def test_connect_error_is_503_and_takes_the_backend_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.port == 9102:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=answer("a", KV))

    app = create_app(_settings("pull"), transport=httpx.MockTransport(handler))
    with UvicornThread(app) as server:
        resp = httpx.post(
            f"{server.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        ready = httpx.get(f"{server.url}/ready")
    assert resp.status_code == 503
    assert "decode instance" in resp.json()["error"]["message"]
    assert ready.status_code == 503
    assert ready.json()["decode"] == []


async def test_slow_health_checks_take_a_backend_out_only_after_the_threshold() -> None:
    """Timeouts count towards health.failure_threshold; a refused connection is immediate."""
    mode = {"decode": "ok"}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 9102 and request.url.path == "/health":
            if mode["decode"] == "refused":
                raise httpx.ConnectError("refused", request=request)
            if mode["decode"] == "slow":
                raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(200, json=answer("a", KV))

    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {"instances": [{"url": P}]},
            "decode": {"instances": [{"url": D}]},
            "health": {"failure_threshold": 3},
        }
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        runtime = Runtime.create(settings, client)
        monitor = HealthMonitor(runtime)
        await monitor.check_all()
        pools = runtime.model("m")
        p_pool, d_pool = pools.prefill, pools.decode
        prefill, decode = p_pool.backends[0], d_pool.backends[0]
        assert prefill.healthy and prefill.identity is not None
        assert prefill.identity.engine_id == "eng"
        mode["decode"] = "slow"
        assert [await monitor.check(decode) for _ in range(3)] == [True, True, False]
        mode["decode"] = "ok"
        assert await monitor.check(decode) is True
        mode["decode"] = "refused"
        assert await monitor.check(decode) is False
