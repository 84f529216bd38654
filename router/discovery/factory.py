"""The discovery source a pool's config asks for."""

from __future__ import annotations

from router.config import DnsDiscovery, KubernetesDiscovery, PoolConfig
from router.discovery.dns import DnsSource
from router.discovery.kubernetes import KubernetesSource
from router.discovery.source import DiscoverySource
from router.discovery.static import StaticSource


def make_source(pool: PoolConfig) -> DiscoverySource:
    """A fresh source for ``pool`` (static: its ``instances`` list)."""
    cfg = pool.discovery
    if isinstance(cfg, DnsDiscovery):
        return DnsSource(cfg)
    if isinstance(cfg, KubernetesDiscovery):
        return KubernetesSource(cfg)
    return StaticSource(pool.instances)
