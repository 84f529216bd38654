"""Consume one discovery source for one pool: keep the last known set, apply changes, report.

Who calls it: :class:`disagg_router.router.discovery.manager.DiscoveryManager`, one
:class:`PoolDiscovery` per discovered pool, its ``run()`` as a background task. Rules: a
:class:`Failed` update, and a :class:`Found` with no instances, keep the last known set (a pool is
never emptied by discovery: an instance that really went away fails its health checks instead) and
mark the pool's discovery as failing in metrics and ``status()``; a changed non-empty set is handed
to ``apply`` (the pool's membership update, which drains removed instances and probes new ones
before use). ``synced`` is set once the first set is known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from disagg_router.router.config import InstanceConfig
from disagg_router.router.discovery.source import DiscoverySource, Failed, Found, Update
from disagg_router.router.observability.metrics import RouterMetrics

log = logging.getLogger(__name__)

Apply = Callable[[tuple[InstanceConfig, ...]], Awaitable[None]]


@dataclass(frozen=True)
class DiscoveryStatus:
    """What ``/ready`` shows for one pool's discovery."""

    source: str
    ok: bool
    instances: tuple[str, ...]
    error: str | None

    def as_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "ok": self.ok,
            "instances": list(self.instances),
            "error": self.error,
        }


class PoolDiscovery:
    """Feeds one pool from one source; see the module docstring for the rules."""

    def __init__(
        self, pool: str, source: DiscoverySource, apply: Apply, metrics: RouterMetrics
    ) -> None:
        self.pool = pool
        self.source = source
        self._apply = apply
        self._metrics = metrics
        self.known: tuple[InstanceConfig, ...] = ()
        self.error: str | None = None
        self.synced = asyncio.Event()

    def status(self) -> DiscoveryStatus:
        labels = tuple(i.label for i in self.known)
        return DiscoveryStatus(self.source.kind, self.error is None, labels, self.error)

    async def run(self) -> None:
        """Consume the source until cancelled."""
        updates = self.source.updates()
        try:
            async for update in updates:
                await self.handle(update)
        finally:
            await updates.aclose()

    def crashed(self, error: str) -> None:
        """The supervisor saw ``run()`` crash: the pool keeps its last set, shown as failing
        until the restarted watcher learns a set again."""
        self.error = f"watcher crashed ({error}); restarting"
        labels = (self.pool, self.source.kind)
        self._metrics.discovery_failures.labels(*labels).inc()
        self._metrics.discovery_ok.labels(*labels).set(0)

    async def handle(self, update: Update) -> None:
        """Fold one update in (public for tests that drive a watcher without a source)."""
        labels = (self.pool, self.source.kind)
        if isinstance(update, Failed) or not update.instances:
            self.error = update.error if isinstance(update, Failed) else "no instances found"
            log.warning("%s discovery: %s; keeping %d", self.pool, self.error, len(self.known))
            self._metrics.discovery_failures.labels(*labels).inc()
            self._metrics.discovery_ok.labels(*labels).set(0)
            return
        self.error = None
        self._metrics.discovery_ok.labels(*labels).set(1)
        if update.instances != self.known:
            self._log_change(update)
            self.known = update.instances
            self._metrics.discovery_changes.labels(*labels).inc()
            self._metrics.discovery_instances.labels(*labels).set(len(update.instances))
            await self._apply(update.instances)
        self.synced.set()

    def _log_change(self, update: Found) -> None:
        before = {i.label for i in self.known}
        after = set(update.labels)
        log.info("%s discovery: +%s -%s", self.pool, sorted(after - before), sorted(before - after))
