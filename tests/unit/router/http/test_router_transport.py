"""The app over scripted upstream servers: leg routing, error mapping, health checks."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx

from devstack.fake_vllm import UvicornThread
from disagg_router.router.config import settings_from_mapping
from disagg_router.router.health.monitor import HealthMonitor
from disagg_router.router.http.app import create_app
from disagg_router.router.runtime import Runtime, http_client
from tests.support.scripted import scripted
from tests.unit.router.mock_upstream import KV, answer, pair


def _settings(mode: str, p: str, d: str, **extra: Any) -> Any:
    """Health re-checks far apart, so a backend taken out stays out during a test."""
    return settings_from_mapping(
        {
            "models": ["m"],
            "mode": mode,
            "prefill": {"instances": [{"url": p}]},
            "decode": {"instances": [{"url": d}]},
            "health": {"interval": 3600, "unhealthy_interval": 3600},
            **extra,
        }
    )


def test_pull_mode_legs_go_to_p_then_d() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        body = json.loads(request.content)
        seen.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}", body))
        if body["kv_transfer_params"].get("do_remote_decode"):
            return httpx.Response(200, json=answer("a", KV))
        return httpx.Response(200, json=answer(" decoded", None))

    with pair(handler) as (p, d), UvicornThread(create_app(_settings("pull", p, d))) as server:
        resp = httpx.post(
            f"{server.url}/v1/completions", json={"model": "m", "prompt": "x y z"}, timeout=10
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == " decoded"
    assert [url for url, _ in seen] == [p, d]
    assert seen[1][1]["kv_transfer_params"] == {
        **KV,
        "transfer_id": seen[0][1]["kv_transfer_params"]["transfer_id"],
    }


def test_every_call_carries_the_instance_key_and_the_request_id() -> None:
    headers: list[tuple[str, str, httpx.Headers]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append((request.method, request.url.path, request.headers))
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        prefill = json.loads(request.content)["kv_transfer_params"].get("do_remote_decode")
        return httpx.Response(200, json=answer("a", KV if prefill else None))

    with pair(handler) as (p, d):
        keyed = {"instances": [{"url": d, "api_key": "d-secret"}]}
        settings = _settings("pull", p, d, decode=keyed)
        with UvicornThread(create_app(settings)) as server:
            resp = httpx.post(
                f"{server.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
            )
    assert resp.status_code == 200, resp.text
    legs = [(path, h) for method, path, h in headers if method == "POST"]
    assert [path for path, _ in legs] == ["/v1/completions", "/v1/completions"]
    assert legs[1][1]["authorization"] == "Bearer d-secret"
    assert "authorization" not in legs[0][1]
    assert legs[0][1]["x-request-id"] and legs[1][1]["x-request-id"]
    assert legs[1][1]["host"] == d.removeprefix("http://")
    checks = [h for method, path, h in headers if (method, path) == ("GET", "/health")]
    assert checks and all(h["x-request-id"] for h in checks)


def test_a_refused_connection_is_503_and_takes_the_backend_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        return httpx.Response(200, json=answer("a", KV))

    with scripted(handler, 2) as (p, d):
        d.stop()  # its port now refuses connections
        with UvicornThread(create_app(_settings("pull", p.url, d.url))) as server:
            body = {"model": "m", "prompt": "x"}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
            ready = httpx.get(f"{server.url}/ready")
    assert resp.status_code == 503
    assert "decode instance" in resp.json()["error"]["message"]
    assert ready.status_code == 503
    assert ready.json()["decode"] == []


async def test_slow_health_checks_take_a_backend_out_only_after_the_threshold() -> None:
    """Timeouts count towards health.failure_threshold; a refused connection is immediate."""
    mode = {"decode": "ok"}
    never = threading.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        health = request.url.path == "/health"
        if request.url.port == d_port and health and mode["decode"] == "slow":
            await asyncio.to_thread(never.wait, 30)  # answers after the check gave up
        if request.method == "GET":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        return httpx.Response(200, json=answer("a", KV))

    d_port = 0
    try:
        with scripted(handler, 2) as (p, d):
            d_port = d.port
            extra = {"health": {"failure_threshold": 3}, "timeouts": {"health": 0.2}}
            settings = _settings("push", p.url, d.url, **extra)
            async with http_client(settings) as client:
                runtime = Runtime.create(settings, client)
                monitor = HealthMonitor(runtime)
                await monitor.check_all()
                pools = runtime.model("m")
                prefill, decode = pools.prefill.backends[0], pools.decode.backends[0]
                assert prefill.healthy and prefill.identity is not None
                assert prefill.identity.engine_id == "eng"
                mode["decode"] = "slow"
                assert [await monitor.check(decode) for _ in range(3)] == [True, True, False]
                mode["decode"] = "ok"
                assert await monitor.check(decode) is True
                never.set()
                d.stop()  # its port now refuses connections: out at once
                assert await monitor.check(decode) is False
    finally:
        never.set()
