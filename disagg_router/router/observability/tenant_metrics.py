"""Per-tenant metrics: requests, tokens, refusals, queue wait, TTFT; and the shared store's state.

Who calls it: :mod:`disagg_router.router.observability.metrics` (``RouterMetrics``) creates one
:class:`TenantMetrics` per registry (its ``tenants``); the tenant limiter
(:mod:`disagg_router.router.tenants.limiter`), the dispatch's admission and the generation
endpoints record into it through that. The
``tenant`` label is only ever a configured tenant's name or ``default``, so the series stay as
few as the config's tenants.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WAIT_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class TenantMetrics:
    """The ``disagg_router_tenant_*`` families of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "disagg_router_tenant_requests",
            "Generation requests by tenant and outcome (rate_limited: refused by the tenant's "
            "own limits)",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "disagg_router_tenant_tokens",
            "Tokens counted against each tenant's tokens_per_minute, by kind (prompt, "
            "completion: from the usage answers report; estimated: charged on admission and "
            "not corrected by a usage)",
            ["tenant", "kind"],
            registry=registry,
        )
        self.rate_limited = Counter(
            "disagg_router_tenant_rate_limited",
            "Requests refused with 429 by a tenant limit, by limit (requests, tokens, "
            "concurrent, model: a model the tenant may not call is a 403, counted here too)",
            ["tenant", "limit"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "disagg_router_tenant_queue_wait_seconds",
            "Seconds a tenant's request waited for its P and D admission slots",
            ["tenant"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "disagg_router_tenant_ttft_seconds",
            "Router-observed time to first token by tenant",
            ["tenant"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.store_errors = Counter(
            "disagg_router_tenant_store_errors",
            "Calls to the shared limits store that failed (each puts this process on local "
            "limits for tenancy.store.retry_after seconds)",
            registry=registry,
        )
        self.store_shared = Gauge(
            "disagg_router_tenant_store_shared",
            "1 while the limits are counted in the shared store, 0 while on local shares",
            multiprocess_mode="liveall",
            registry=registry,
        )
