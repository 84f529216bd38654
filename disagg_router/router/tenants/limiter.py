"""A tenant's limits, counted on admission and corrected when the answer ends.

Who calls it: the runtime's :class:`disagg_router.router.tenants.Tenancy` holds one (the package
:mod:`disagg_router.router.tenants` imports it): the app's admission checks call
:meth:`Limiter.admit` once per generation request, after its input is valid; the generation endpoint
calls :meth:`Pass.finish` exactly once when the request ends (after its dispatch closed, so
``max_concurrent`` counts requests holding P or D, not client connections). The app's lifespan
builds one :class:`Limiter` per app run, calls :meth:`Limiter.configure` at start and on each reload
(through :class:`disagg_router.router.tenants.Tenancy`), and :meth:`Limiter.close` at the end.

Per-minute limits are buckets refilled at ``limit / 60`` per second that hold ``tenancy.burst``
seconds' worth (:mod:`disagg_router.router.tenants.bucket`): with ``tenancy.store`` they live in
Redis (:mod:`disagg_router.router.tenants.store`), one bucket for every replica; without one each
process fills its own at its share, ``limit / tenancy.replicas`` (rounded up). A store call that
fails puts this process on its local shares for ``store.retry_after`` seconds: logged once per
outage, counted, never an error for the client. ``max_concurrent`` is always counted per process, as
its share."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from disagg_router.router.config import TenancyConfig
from disagg_router.router.errors import RateLimited
from disagg_router.router.observability.tenant_metrics import TenantMetrics
from disagg_router.router.tenants.bucket import Bucket, Rate, Usage
from disagg_router.router.tenants.headers import rate_limit_headers
from disagg_router.router.tenants.identity import Tenant
from disagg_router.router.tenants.store import SharedBuckets, StoreUnavailable

log = logging.getLogger(__name__)

REQUESTS, TOKENS, CONCURRENT = "requests", "tokens", "concurrent"


class Pass:
    """One admitted request's claim on its tenant's limits (see the module docstring)."""

    def __init__(self, limiter: Limiter | None, tenant: Tenant, tokens: int) -> None:
        self.tenant = tenant
        self.tokens = tokens
        self.headers: dict[str, str] = {}
        self._limiter = limiter

    def finish(self, usage: Any) -> None:
        """The request ended (``usage``: the answer's usage object, or None when none was
        reported): give back its concurrency and correct its token count. Idempotent."""
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter.finish(self, usage)


class Limiter:
    """The per-tenant counts of one app run (single event loop, no locking)."""

    def __init__(self, metrics: TenantMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._config = TenancyConfig()
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._in_flight: dict[str, int] = {}
        self._store: SharedBuckets | None = None
        self._local_until = 0.0
        self._shared = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def configure(self, config: TenancyConfig) -> None:
        """Take ``config`` (start, reload): a changed store is replaced (the old one closed in
        the background); the counts of tenants that stay are kept, with their new limits."""
        old = self._config.store
        self._config = config
        if config.store != old and self._store is not None:
            self._background(self._store.close())
            self._store = None
        if config.store is not None and self._store is None:
            self._store = SharedBuckets(config.store)
            self._local_until = 0.0
        self._shared = self._store is not None
        self._metrics.store_shared.set(1 if self._shared else 0)

    async def settle(self) -> None:
        """Wait until the corrections (and store closes) running in the background ended."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Wait for pending corrections, then close the store (the app's end)."""
        await self.settle()
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def admit(self, tenant: Tenant, tokens: int) -> Pass:
        """A :class:`Pass` for one request of ``tenant`` charged ``tokens``, or
        :class:`~disagg_router.router.errors.RateLimited` (429, with the headers) when one of
        its limits is reached. A tenant without limits costs nothing here."""
        if not tenant.limited:
            return Pass(None, tenant, tokens)
        self._check_concurrency(tenant)
        lim = tenant.limits
        headers: dict[str, str] = {}
        if lim.requests_per_minute is not None:
            fits, usage = await self._take(tenant, REQUESTS, lim.requests_per_minute, 1)
            headers |= rate_limit_headers(REQUESTS, usage)
            if not fits:
                self._refuse(tenant, REQUESTS, usage, 1, headers)
        if lim.tokens_per_minute is not None:
            fits, usage = await self._take(tenant, TOKENS, lim.tokens_per_minute, tokens)
            headers |= rate_limit_headers(TOKENS, usage)
            if not fits:
                if lim.requests_per_minute is not None:  # this request is not counted
                    _, back = await self._take(
                        tenant, REQUESTS, lim.requests_per_minute, -1, force=True
                    )
                    headers |= rate_limit_headers(REQUESTS, back)
                self._refuse(tenant, TOKENS, usage, tokens, headers)
        self._in_flight[tenant.name] = self._in_flight.get(tenant.name, 0) + 1
        granted = Pass(self, tenant, tokens if lim.tokens_per_minute is not None else 0)
        granted.headers = headers
        return granted

    def finish(self, granted: Pass, usage: Any) -> None:
        """:meth:`Pass.finish`'s work: concurrency back; the token count corrected to what the
        answer's usage reports (in the background when it goes to the store)."""
        name = granted.tenant.name
        self._in_flight[name] = max(self._in_flight.get(name, 0) - 1, 0)
        used = _used_tokens(usage)
        limit = granted.tenant.limits.tokens_per_minute
        if used is None or limit is None or used == granted.tokens:
            return
        self._background(
            self._take(granted.tenant, TOKENS, limit, used - granted.tokens, force=True)
        )

    def _background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` (a correction, a store's close) as a task kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._background_done)

    def _check_concurrency(self, tenant: Tenant) -> None:
        cap = tenant.limits.max_concurrent
        if cap is not None and self._in_flight.get(tenant.name, 0) >= self._share(cap):
            self._metrics.rate_limited.labels(tenant.name, CONCURRENT).inc()
            raise RateLimited(
                f"Rate limit reached for tenant {tenant.name} on requests in flight: "
                f"limit {cap}. Retry once one of its requests has ended.",
                CONCURRENT,
                retry_after=1,
                headers={},
            )

    def _refuse(
        self, tenant: Tenant, kind: str, usage: Usage, amount: int, headers: dict[str, str]
    ) -> None:
        self._metrics.rate_limited.labels(tenant.name, kind).inc()
        wait = usage.wait_for(amount)
        raise RateLimited(
            f"Rate limit reached for tenant {tenant.name} on {kind} per min: limit "
            f"{usage.limit}, remaining {usage.remaining}, requested {amount}. Please try again in "
            f"{wait:.1f}s.",
            kind,
            retry_after=max(math.ceil(wait - 1e-6), 1),  # float dust: not a second more
            headers=headers,
        )

    async def _take(
        self, tenant: Tenant, kind: str, limit: int, amount: int, force: bool = False
    ) -> tuple[bool, Usage]:
        """Count ``amount`` in the store, or locally (this process's share) while it is away."""
        burst = self._config.burst
        if self._store is not None and self._clock() >= self._local_until:
            try:
                counted = await self._store.take(
                    f"{tenant.name}:{kind}", Rate(limit, burst), amount, force
                )
            except StoreUnavailable as exc:
                self._store_failed(exc)
            else:
                self._set_shared(True)
                return counted
        bucket = self._buckets.setdefault((tenant.name, kind), Bucket())
        return bucket.take(Rate(self._share(limit), burst), amount, self._clock(), force)

    def _share(self, limit: int) -> int:
        return max(math.ceil(limit / self._config.replicas), 1)

    def _store_failed(self, exc: StoreUnavailable) -> None:
        """Count the failure; the first of an outage is logged and starts the local period."""
        self._metrics.store_errors.inc()
        store = self._config.store
        retry = store.retry_after if store is not None else 0.0
        if self._shared:
            log.warning("tenancy store unavailable (%s): local limits for %gs", exc, retry)
            self._set_shared(False)
        self._local_until = self._clock() + retry

    def _set_shared(self, shared: bool) -> None:
        if shared != self._shared:
            self._shared = shared
            self._metrics.store_shared.set(1 if shared else 0)
            if shared:
                log.info("tenancy store answers again: shared limits")

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        """A background task ended; one that raised (the store's failure is handled inside
        :meth:`_take`, so this is a bug) is logged and counted, its work lost."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._metrics.store_errors.inc()
            log.error("tenancy background task failed", exc_info=exc)


def _used_tokens(usage: Any) -> int | None:
    """Prompt plus completion tokens of an answer's usage object; None when absent."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt + completion
