"""Runs discovery for every discovered pool of a running router and feeds the pools.

Who calls it: the app lifespan (:mod:`disagg_router.router.http.app`) builds one
:class:`DiscoveryManager` per app run, calls :meth:`DiscoveryManager.sync` at start and after every
applied config reload, and :meth:`DiscoveryManager.close` at shutdown. For each pool whose config
has a non-static ``discovery`` it runs one
:class:`~disagg_router.router.discovery.watcher.PoolDiscovery`; a changed set goes through the one
membership update (:meth:`disagg_router.router.routing.table.LiveRouting.set_instances`): instances
that left are drained (no new legs; legs in flight finish), instances that joined wait unhealthy
until ``check`` (a health check and, for P in push mode, an identity probe) passes. Static pools get
nothing from here: their members come from the config (and its reloads). Each watcher runs under the
supervisor (:mod:`disagg_router.router.supervisor`): a watcher that crashes (an unexpected error in
its source) is logged, counted, marked failing in ``status()`` and restarted with a growing delay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from disagg_router.router.config import DiscoveryConfig, InstanceConfig, PoolConfig
from disagg_router.router.discovery.factory import make_source
from disagg_router.router.discovery.source import DiscoverySource
from disagg_router.router.discovery.watcher import DiscoveryStatus, PoolDiscovery
from disagg_router.router.reload import CheckBackends
from disagg_router.router.routing.pools import Pool
from disagg_router.router.runtime import Runtime
from disagg_router.router.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Running:
    pool: Pool
    config: DiscoveryConfig
    watcher: PoolDiscovery
    task: asyncio.Task[None]


class DiscoveryManager:
    """One watcher task per discovered pool of ``runtime``'s current routing table."""

    def __init__(
        self,
        runtime: Runtime,
        check: CheckBackends,
        make: Callable[[PoolConfig], DiscoverySource] = make_source,
        supervisor: Supervisor | None = None,
    ) -> None:
        """``supervisor``: runs each pool's watcher (restarted when it crashes); the app's one,
        or one of the manager's own."""
        self.runtime = runtime
        self._check = check
        self._make = make
        self.supervisor = supervisor or Supervisor(runtime.metrics)
        self._running: dict[tuple[str, str], _Running] = {}
        self._checks: set[asyncio.Task[None]] = set()

    def sync(self) -> None:
        """Start watchers for discovered pools that have none (or whose discovery config
        changed), stop those of pools that are gone or no longer discovered."""
        wanted: dict[tuple[str, str], Pool] = {
            (pool.model, pool.role): pool
            for pool in self.runtime.pools
            if pool.config.discovery.source != "static"
        }
        for key, running in list(self._running.items()):
            pool = wanted.get(key)
            if pool is None or pool is not running.pool or pool.config.discovery != running.config:
                running.task.cancel()
                del self._running[key]
        for key, pool in wanted.items():
            if key not in self._running:
                self._running[key] = self._start(pool)

    def _start(self, pool: Pool) -> _Running:
        name = f"{pool.model}/{pool.role}" if pool.model else pool.role

        async def apply(instances: tuple[InstanceConfig, ...]) -> None:
            self._apply(pool, instances)

        watcher = PoolDiscovery(name, self._make(pool.config), apply, self.runtime.metrics)
        log.info("%s: discovering instances (%s)", name, pool.config.discovery.source)
        task = self.supervisor.start(f"discovery {name}", watcher.run, on_crash=watcher.crashed)
        return _Running(pool, pool.config.discovery, watcher, task)

    def _apply(self, pool: Pool, instances: tuple[InstanceConfig, ...]) -> None:
        change = self.runtime.routing.set_instances(pool, instances)
        if change.added:
            task = asyncio.create_task(self._check(change.added))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    def status(self) -> dict[str, dict[str, DiscoveryStatus]]:
        """Per model, per role: the discovery status (discovered pools only)."""
        out: dict[str, dict[str, DiscoveryStatus]] = {}
        for (model, role), running in sorted(self._running.items()):
            out.setdefault(model, {})[role] = running.watcher.status()
        return out

    async def close(self) -> None:
        """Stop every watcher and pending check."""
        tasks = [r.task for r in self._running.values()] + list(self._checks)
        self._running.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
