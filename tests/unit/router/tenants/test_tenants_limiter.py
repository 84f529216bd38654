"""A tenant's limits in one process: requests and tokens per minute, concurrency, corrections,
shares between replicas, reloads (fake clock, no store; bursts of a whole minute's worth, so the
counts read as a minute's)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from disagg_router.router.config import TenancyConfig, TenantConfig, TenantLimits
from disagg_router.router.errors import RateLimited
from disagg_router.router.observability.tenant_metrics import TenantMetrics
from disagg_router.router.tenants import Directory, Limiter, Tenant, hash_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(**limits: object) -> Tenant:
    config = TenancyConfig(
        tenants=[TenantConfig(name="t", key_sha256=[hash_key("k")], **limits)]  # type: ignore[arg-type]
    )
    return Directory(config, []).identify("Bearer k")


def limiter(replicas: int = 1) -> tuple[Limiter, Clock, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    lim = Limiter(TenantMetrics(registry), clock)
    lim.configure(TenancyConfig(replicas=replicas, burst=60))  # a minute's worth at once
    return lim, clock, registry


async def test_requests_per_minute_refuse_with_429_retry_after_and_headers() -> None:
    lim, clock, registry = limiter()
    t = tenant(requests_per_minute=2)
    first = await lim.admit(t, 0)
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    await lim.admit(t, 0)
    clock.now += 10
    with pytest.raises(RateLimited) as caught:
        await lim.admit(t, 0)
    err = caught.value
    # 10 s refilled a third of a request (one per 30 s): the next whole one in 20 s
    assert (err.status, err.limit, err.retry_after) == (429, "requests", 20)
    assert err.headers["x-ratelimit-limit-requests"] == "2"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    refused = {"tenant": "t", "limit": "requests"}
    assert registry.get_sample_value("disagg_router_tenant_rate_limited_total", refused) == 1
    clock.now += 20
    await lim.admit(t, 0)


async def test_tokens_are_charged_on_admission_and_corrected_by_the_usage() -> None:
    lim, _, _ = limiter()
    t = tenant(tokens_per_minute=100, requests_per_minute=10)
    granted = await lim.admit(t, 80)
    assert granted.headers["x-ratelimit-remaining-tokens"] == "20"
    granted.finish({"prompt_tokens": 20, "completion_tokens": 10})
    await lim.settle()  # the correction runs in the background
    second = await lim.admit(t, 60)
    assert second.headers["x-ratelimit-remaining-tokens"] == "10"
    with pytest.raises(RateLimited) as caught:
        await lim.admit(t, 20)
    assert caught.value.limit == "tokens"
    # the refused request gave its request count back: 2 of 10 used
    assert caught.value.headers["x-ratelimit-remaining-requests"] == "8"


async def test_concurrency_counts_until_the_pass_is_finished() -> None:
    lim, _, _ = limiter()
    t = tenant(max_concurrent=2)
    passes = [await lim.admit(t, 0), await lim.admit(t, 0)]
    with pytest.raises(RateLimited) as caught:
        await lim.admit(t, 0)
    assert caught.value.limit == "concurrent"
    passes[0].finish(None)
    passes[0].finish(None)  # idempotent: gives back one, not two
    await lim.admit(t, 0)
    with pytest.raises(RateLimited):
        await lim.admit(t, 0)


async def test_without_a_store_each_replica_enforces_its_share() -> None:
    lim, _, _ = limiter(replicas=3)
    t = tenant(requests_per_minute=10)
    for _ in range(4):  # ceil(10 / 3)
        await lim.admit(t, 0)
    with pytest.raises(RateLimited) as caught:
        await lim.admit(t, 0)
    assert caught.value.headers["x-ratelimit-limit-requests"] == "4"


async def test_a_reload_keeps_the_counts_and_applies_the_new_limit() -> None:
    lim, _, _ = limiter()
    for _ in range(3):
        await lim.admit(tenant(requests_per_minute=5), 0)
    with pytest.raises(RateLimited):
        await lim.admit(tenant(requests_per_minute=3), 0)
    granted = await lim.admit(tenant(requests_per_minute=6), 0)
    assert granted.headers["x-ratelimit-remaining-requests"] == "2"


async def test_a_tenant_without_limits_gets_no_headers_and_no_counts() -> None:
    lim, _, _ = limiter()
    plain = Directory(TenancyConfig(), []).identify("")
    assert plain.limits == TenantLimits()
    for _ in range(100):
        granted = await lim.admit(plain, 10**6)
        assert granted.headers == {}
