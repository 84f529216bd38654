"""The one object a running router app shares: HTTP client, metrics and the routing table.

Who builds it: the app lifespan (:func:`open_runtime`), once per app run; tests may build one with
:meth:`Runtime.create` around their own client. Everything that serves a request (dispatch,
orchestration, health monitor, endpoints) receives this object instead of its parts.
The runtime itself is immutable; its :class:`LiveRouting` holds the current config and per-model
pools (swapped whole by hot reload), and the pools and backends carry the state that changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from disagg_router.router.config import RouterSettings, TracingConfig
from disagg_router.router.instances.registry import BackendHooks
from disagg_router.router.instances.state import BackendState
from disagg_router.router.lifecycle import Lifecycle
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.observability.tracing import NoTracer, Tracer
from disagg_router.router.routing.kv_routing import KvRouting
from disagg_router.router.routing.pools import Pool
from disagg_router.router.routing.table import LiveRouting, ModelPools
from disagg_router.router.tenants import Tenancy
from disagg_router.router.upstream.client import ClientLimits, UpstreamClient


@dataclass(frozen=True)
class Runtime:
    """Shared objects of one app run (one client, one metrics registry, the routing table, the
    tracer, the start/stop state)."""

    client: UpstreamClient
    metrics: RouterMetrics
    routing: LiveRouting
    tenancy: Tenancy
    """Who calls and how much (tenants' keys and limits); configured by the lifespan."""
    tracer: Tracer = field(default_factory=NoTracer)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    kv: KvRouting = field(default_factory=KvRouting)
    """KV-aware routing state (tokenizers, KV indexes, event streams); run by the lifespan."""

    @property
    def settings(self) -> RouterSettings:
        """The config currently in force (hot reload replaces it)."""
        return self.routing.table.settings

    @classmethod
    def create(
        cls,
        settings: RouterSettings,
        client: UpstreamClient,
        metrics: RouterMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> Runtime:
        """A runtime with fresh pools (and a fresh metrics registry unless one is given); the
        pools report breaker changes and departed instances to the metrics."""
        metrics = metrics or RouterMetrics(CollectorRegistry())
        client.on_stale_retry(metrics.count_stale_retry)
        hooks = BackendHooks(
            breaker_changed=lambda b, is_open: metrics.set_breaker_open(b.role, b.label, is_open),
            forget=metrics.forget_backend,
        )
        return cls(
            client=client,
            metrics=metrics,
            routing=LiveRouting(settings, hooks),
            tenancy=Tenancy(metrics.tenants),
            tracer=tracer or NoTracer(),
        )

    @property
    def pools(self) -> list[Pool]:
        """Every pool of every served model (P then D per model)."""
        return self.routing.table.pools()

    def model(self, model: str) -> ModelPools:
        """The current pools and rule for ``model``; 404 :class:`ClientRequestError` if unknown."""
        return self.routing.table.lookup(model)

    def backends(self) -> list[BackendState]:
        """Every backend of every pool, once each (an instance several pools list is one)."""
        return self.routing.table.backends()


UPSTREAM_MAX_CONNECTIONS = 4096
"""Open upstream connections at most (a request beyond waits, up to ``timeouts.connect``)."""

UPSTREAM_KEEPALIVE_S = 4.0
"""How long the upstream client keeps an idle connection: under the 5 s after which vLLM's
server (uvicorn) closes one."""


def http_client(settings: RouterSettings) -> UpstreamClient:
    """The one upstream client (:mod:`disagg_router.router.upstream.client`): explicit timeouts,
    generous pool limits. Each wait for an answer's next bytes is bounded by ``timeouts.total``
    (callers bound whole calls more tightly). An idle connection is dropped after
    :data:`UPSTREAM_KEEPALIVE_S`, before vLLM's server closes it (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
    5 s), or sooner when the instance says ``Keep-Alive: timeout``; a request whose reused
    connection turns out closed before any answer byte is sent again once on a new one.
    """
    t = settings.timeouts
    limits = ClientLimits(
        connect_s=t.connect,
        read_s=t.total,
        keepalive_s=UPSTREAM_KEEPALIVE_S,
        max_connections=UPSTREAM_MAX_CONNECTIONS,
    )
    return UpstreamClient(limits)


def make_tracer(config: TracingConfig) -> Tracer:
    """The tracer for ``config``; imports OpenTelemetry (an optional dependency) only when
    tracing is enabled."""
    if not config.enabled:
        return NoTracer()
    from disagg_router.router.observability.otel import OtelTracer

    return OtelTracer(config)


@asynccontextmanager
async def open_runtime(settings: RouterSettings) -> AsyncIterator[Runtime]:
    """A runtime whose client (and tracer) are closed on exit."""
    tracer = make_tracer(settings.tracing)
    try:
        async with http_client(settings) as client:
            yield Runtime.create(settings, client, tracer=tracer)
    finally:
        tracer.shutdown()
