"""Tenants over HTTP on a real router with fake vLLM instances: keys, models, each limit and its
headers, fair and prioritized admission under contention, a reload mid-traffic, and two replicas
sharing a real Redis store that then goes away."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from devstack.fake_vllm import FakeBehavior, FakeVllmServer, UvicornThread
from disagg_router.router.config import load_config, settings_from_mapping
from disagg_router.router.tenants import hash_key
from tests.integration.router.router_fixtures import MODEL, make_settings, running_router
from tests.support.redis_server import running_redis
from tests.support.wait import wait_until

KEYS = {"acme": "sk-acme", "zeta": "sk-zeta", "low": "sk-low", "high": "sk-high"}


def tenant(name: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": [hash_key(KEYS[name])], **limits}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def complete(url: str, who: str, prompt: str = "hello", **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=auth(who), timeout=30)


def tenants_router(fake: dict[str, FakeVllmServer], *tenants: dict[str, Any], **extra: Any) -> Any:
    # burst 60: a whole minute's worth at once, so a test's few requests read as a minute's
    tenancy = {"tenants": list(tenants), "burst": 60, **extra.pop("tenancy", {})}
    settings = make_settings([fake["p0"].url], [fake["d0"].url], tenancy=tenancy, **extra)
    return running_router(settings)


def test_keys_name_tenants_and_unknown_keys_get_401(fake: dict[str, FakeVllmServer]) -> None:
    with tenants_router(fake, tenant("acme")) as router:
        assert complete(router.url, "acme").status_code == 200
        resp = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={"Authorization": "Bearer sk-nobody"},
        )
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"


def test_a_model_the_tenant_may_not_call_is_404_and_absent_from_its_list(
    fake: dict[str, FakeVllmServer],
) -> None:
    settings = make_settings(
        [fake["p0"].url],
        [fake["d0"].url],
        tenancy={"tenants": [tenant("acme", models=[MODEL])]},
    ).model_dump()
    settings["models"] = [MODEL, "other-model"]
    settings["tenancy"]["tenants"].append(tenant("zeta", models=["other-model"]))
    with running_router(settings_from_mapping(settings)) as router:
        resp = complete(router.url, "zeta")
        assert resp.status_code == 404
        assert resp.json()["error"]["param"] == "model"
        assert resp.json()["error"]["message"].endswith("served models: other-model")
        listed = httpx.get(f"{router.url}/v1/models", headers=auth("zeta")).json()["data"]
        assert [c["id"] for c in listed] == ["other-model"]
        assert fake["d0"].state.completed == 0


def test_requests_per_minute_give_429_with_retry_after_and_openai_headers(
    fake: dict[str, FakeVllmServer],
) -> None:
    with tenants_router(fake, tenant("acme", requests_per_minute=2)) as router:
        first = complete(router.url, "acme")
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"].endswith("s")
        streamed = complete(router.url, "acme", stream=True)
        assert streamed.status_code == 200
        assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
        refused = complete(router.url, "acme")
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        served = len(fake["d0"].state.generation_requests())
        assert served == 2  # the refused request reached no instance


def test_tokens_per_minute_count_prompt_and_max_tokens(fake: dict[str, FakeVllmServer]) -> None:
    # "x " * 200 is ~100 tokens at 4 characters per token; max_tokens 50: ~150 charged.
    with tenants_router(fake, tenant("acme", tokens_per_minute=400)) as router:
        ok = complete(router.url, "acme", prompt="x " * 200, max_tokens=50)
        assert ok.status_code == 200
        left = int(ok.headers["x-ratelimit-remaining-tokens"])
        assert 200 <= left <= 300
        big = complete(router.url, "acme", prompt="x " * 800, max_tokens=50)
        assert big.status_code == 429
        assert big.json()["error"]["type"] == "tokens"
        assert big.headers["x-ratelimit-limit-tokens"] == "400"


@contextmanager
def held_stream(url: str, who: str, prompt: str) -> Iterator[None]:
    """A streamed request (its D stalls after one token) that the client abandons when this
    context ends: run on its own event loop, cancelled from here."""
    loop = asyncio.new_event_loop()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}

    async def run() -> None:
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"{url}/v1/completions", json=body, headers=auth(who)) as resp,
        ):
            async for _ in resp.aiter_bytes():
                pass

    task = loop.create_task(run())

    def until_cancelled() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=until_cancelled, daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=30)
        loop.close()


def test_max_concurrent_counts_requests_until_their_dispatch_closes(
    fake: dict[str, FakeVllmServer],
) -> None:
    with tenants_router(fake, tenant("acme", max_concurrent=1)) as router:
        fake["d0"].state.behavior = FakeBehavior(stall_after_tokens=1, fail_times=1)
        with held_stream(router.url, "acme", "first"):
            fake["d0"].state.wait_for(lambda s: s.in_flight == 1)
            refused = complete(router.url, "acme")
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "concurrent"
        wait_until(lambda: complete(router.url, "acme").status_code == 200, what="the slot back")


def _queued(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("disagg_router_admission_queue_length{") and 'role="decode"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _order_of_arrival(
    fake: dict[str, FakeVllmServer], router: UvicornThread, blocker: str, queue: list[str]
) -> list[str]:
    """Hold D's one slot with ``blocker``'s stream, queue one request of each tenant named in
    ``queue`` (in that order, each queued before the next is sent), free the slot, and return
    the prompts in the order P received them."""
    fake["d0"].state.behavior = FakeBehavior(stall_after_tokens=1, fail_times=1)
    threads = []
    with held_stream(router.url, blocker, "blocker"):
        fake["d0"].state.wait_for(lambda s: s.in_flight == 1)
        for i, who in enumerate(queue):
            thread = threading.Thread(target=complete, args=(router.url, who, f"{who}-{i}"))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=i + 1: _queued(router.url) == n, what=f"{i + 1} queued")
    for thread in threads:
        thread.join(timeout=30)
    prompts = [r.body.get("prompt") for r in fake["p0"].state.generation_requests()]
    return [p for p in prompts if isinstance(p, str) and "-" in p]


def test_a_noisy_tenants_queued_burst_does_not_go_before_another_tenant(
    fake: dict[str, FakeVllmServer],
) -> None:
    admission = {"max_in_flight": 1, "queue_size": 16, "max_wait": 30}
    with tenants_router(fake, tenant("acme"), tenant("zeta"), admission=admission) as router:
        order = _order_of_arrival(fake, router, "acme", ["acme", "acme", "acme", "zeta"])
    assert order == ["acme-0", "zeta-3", "acme-1", "acme-2"]


def test_a_higher_priority_tenant_goes_before_queued_lower_ones(
    fake: dict[str, FakeVllmServer],
) -> None:
    admission = {"max_in_flight": 1, "queue_size": 16, "max_wait": 30}
    with tenants_router(
        fake,
        tenant("low", priority="low"),
        tenant("high", priority="high"),
        admission=admission,
        tenancy={"max_priority_wait": 60},
    ) as router:
        order = _order_of_arrival(fake, router, "low", ["low", "low", "high"])
    assert order == ["high-2", "low-0", "low-1"]


def test_a_reload_changes_a_tenants_limit_mid_traffic(
    fake: dict[str, FakeVllmServer], tmp_path: Path
) -> None:
    path = tmp_path / "router.yaml"

    def write(rpm: int) -> None:
        data = make_settings(
            [fake["p0"].url],
            [fake["d0"].url],
            tenancy={"tenants": [tenant("acme", requests_per_minute=rpm)], "burst": 60},
            reload={"watch": True},
        ).model_dump(exclude_defaults=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(data))
        tmp.replace(path)

    write(2)
    with running_router(load_config(path), config_path=path) as router:
        assert [complete(router.url, "acme").status_code for _ in range(3)] == [200, 200, 429]
        write(4)
        wait_until(lambda: _reloads(router.url) == 1, what="the reload")
        after = [complete(router.url, "acme") for _ in range(3)]
        assert [r.status_code for r in after] == [200, 200, 429]
        assert after[0].headers["x-ratelimit-limit-requests"] == "4"


def _reloads(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('disagg_router_config_reloads_total{result="applied"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_replicas_share_one_store_and_fall_back_to_their_shares_when_it_goes(
    fake: dict[str, FakeVllmServer],
) -> None:
    """Two routers over one real Redis: one count of 4 requests per minute between them;
    once Redis is gone, each enforces its share (2) and no client sees a 5xx."""
    with running_redis() as server:
        store = {"url": server.url, "timeout": 0.5, "retry_after": 60}
        tenancy = {"replicas": 2, "store": store}
        acme = tenant("acme", requests_per_minute=4)
        with (
            tenants_router(fake, acme, tenancy=tenancy) as a,
            tenants_router(fake, acme, tenancy=tenancy) as b,
        ):
            shared = [complete(r.url, "acme") for r in (a, b, a, b, a, b)]
            assert [r.status_code for r in shared] == [200, 200, 200, 200, 429, 429]
            assert shared[3].headers["x-ratelimit-limit-requests"] == "4"
            assert _metric(a.url, "disagg_router_tenant_store_shared") == 1
            server.stop()
            alone = [complete(a.url, "acme").status_code for _ in range(3)]
            assert alone == [200, 200, 429]
            assert _metric(a.url, "disagg_router_tenant_store_shared") == 0
            assert _metric(a.url, "disagg_router_tenant_store_errors_total") >= 1


def _leg_priorities(fake: dict[str, FakeVllmServer], prompt: str) -> list[object]:
    legs = [
        r
        for name in ("p0", "d0")
        for r in fake[name].state.generation_requests()
        if r.body.get("prompt") == prompt
    ]
    assert len(legs) == 2  # P's leg and D's
    return [r.body.get("priority", "absent") for r in legs]


def test_engine_priority_sends_the_tenants_class_to_both_legs(
    fake: dict[str, FakeVllmServer],
) -> None:
    tenants = (tenant("high", priority="high"), tenant("low", priority="low"))
    with tenants_router(fake, *tenants, tenancy={"engine_priority": True}) as router:
        assert complete(router.url, "high", "h", priority=5).status_code == 200
        assert complete(router.url, "low", "l", priority=-5).status_code == 200
    assert _leg_priorities(fake, "h") == [0, 0]  # the client's own priority is overridden
    assert _leg_priorities(fake, "l") == [2, 2]


def test_without_engine_priority_a_clients_own_priority_is_dropped(
    fake: dict[str, FakeVllmServer],
) -> None:
    with tenants_router(fake, tenant("low", priority="low")) as router:
        assert complete(router.url, "low", "l", priority=-100).status_code == 200
    assert _leg_priorities(fake, "l") == ["absent", "absent"]
