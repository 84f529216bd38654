"""Tenants: who is calling (an API key's tenant), what it may call, and how much.

Who calls it: the app (:mod:`disagg_router.router.http.app`) identifies each request's tenant and
admits it against the tenant's limits through the runtime's one :class:`Tenancy`; the dispatch
places the request in the instances' admission queues by the tenant's claim (the instances'
fairness module orders them). The pieces: :mod:`.identity` (keys to tenants),
:mod:`.limiter` (per-minute and concurrency limits), :mod:`.bucket` (a per-minute limit's bucket),
:mod:`.store` (the buckets in Redis, shared by replicas), :mod:`.headers` (OpenAI's rate-limit
headers).
"""

from __future__ import annotations

from disagg_router.router.config import RouterSettings
from disagg_router.router.observability.tenant_metrics import TenantMetrics
from disagg_router.router.tenants.identity import Directory, Tenant, hash_key
from disagg_router.router.tenants.limiter import Limiter, Pass

__all__ = ["Directory", "Limiter", "Pass", "Tenancy", "Tenant", "hash_key"]


class Tenancy:
    """The tenants of one app run: the directory of the config in force and the limiter."""

    def __init__(self, metrics: TenantMetrics) -> None:
        self.limiter = Limiter(metrics)
        self._directory: Directory | None = None

    def directory(self, settings: RouterSettings) -> Directory:
        """The directory of ``settings`` (rebuilt when a reload changed its tenants or keys)."""
        found = self._directory
        if found is None or not (
            found.config is settings.tenancy and found.api_keys is settings.api_keys
        ):
            found = self._directory = Directory(settings.tenancy, settings.api_keys)
        return found

    def configure(self, settings: RouterSettings) -> None:
        """Apply ``settings``' tenancy (the app's start and each reload)."""
        self.limiter.configure(settings.tenancy)
        self.directory(settings)

    async def close(self) -> None:
        await self.limiter.close()
