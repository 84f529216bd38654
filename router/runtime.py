"""The one object a running router app shares: settings, HTTP client, metrics and pools.

Who builds it: the app lifespan (:func:`open_runtime`), once per app run; tests may build one with
:meth:`Runtime.create` around their own client. Everything that serves a request (dispatch,
orchestration, health monitor, endpoints) receives this object instead of its parts.
The runtime itself is immutable; the pools and their backends carry the state that changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from router.backends import BackendState
from router.config import RouterSettings
from router.metrics import RouterMetrics
from router.pools import Pool


@dataclass(frozen=True)
class Runtime:
    """Shared objects of one app run (one client, one metrics registry, the P and D pools)."""

    settings: RouterSettings
    client: httpx.AsyncClient
    metrics: RouterMetrics
    prefill: Pool
    decode: Pool

    @classmethod
    def create(
        cls,
        settings: RouterSettings,
        client: httpx.AsyncClient,
        metrics: RouterMetrics | None = None,
    ) -> Runtime:
        """A runtime with fresh pools (and a fresh metrics registry unless one is given)."""
        return cls(
            settings=settings,
            client=client,
            metrics=metrics or RouterMetrics(CollectorRegistry()),
            prefill=Pool("prefill", settings.prefill, require_identity=settings.mode == "push"),
            decode=Pool("decode", settings.decode, require_identity=False),
        )

    @property
    def pools(self) -> tuple[Pool, Pool]:
        """Every pool (P then D)."""
        return (self.prefill, self.decode)

    def pools_for(self, model: str) -> tuple[Pool, Pool]:
        """The (P, D) pools that serve ``model`` (every model is served by the same two)."""
        del model
        return (self.prefill, self.decode)

    def backends(self) -> list[BackendState]:
        """Every backend of every pool."""
        return [b for pool in self.pools for b in pool.backends]


def http_client(
    settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one upstream client: explicit timeouts, generous pool limits."""
    t = settings.timeouts
    timeout = httpx.Timeout(connect=t.connect, read=t.total, write=t.total, pool=t.connect)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    return httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)


@asynccontextmanager
async def open_runtime(
    settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None
) -> AsyncIterator[Runtime]:
    """A runtime whose client is closed on exit; ``transport`` replaces the network (tests)."""
    async with http_client(settings, transport) as client:
        yield Runtime.create(settings, client)
