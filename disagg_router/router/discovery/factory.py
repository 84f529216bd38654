"""The discovery source a discovered pool's config asks for.

Who calls it: :class:`disagg_router.router.discovery.manager.DiscoveryManager`, for pools whose
``discovery`` is not static (a static pool's members come from the config and its reloads, not a
source)."""

from __future__ import annotations

from disagg_router.router.config import DnsDiscovery, KubernetesDiscovery, PoolConfig
from disagg_router.router.discovery.dns import DnsSource
from disagg_router.router.discovery.kubernetes import KubernetesSource
from disagg_router.router.discovery.source import DiscoverySource


def make_source(pool: PoolConfig) -> DiscoverySource:
    """A fresh source for ``pool``; ValueError for a static pool (it has none)."""
    cfg = pool.discovery
    if isinstance(cfg, DnsDiscovery):
        return DnsSource(cfg)
    if isinstance(cfg, KubernetesDiscovery):
        return KubernetesSource(cfg)
    raise ValueError("a static pool has no discovery source: its instances are configured")
