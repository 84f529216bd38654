"""Periodic health checks and prefill identity probes.

Who calls it: the app lifespan (:mod:`disagg_router.router.http.app`; one :class:`HealthMonitor` per
runtime) runs ``run()`` until shutdown: the first check of every backend at once (the router serves
``/health`` meanwhile; ``/ready`` says what is still missing), then periodic checks, and a half-open
probe of every backend whose breaker is open and whose backoff has passed. It runs under the app's
supervisor, which restarts it if it crashes. ``/health`` is bounded by ``timeouts.health``, an
identity probe (a real 1-token prefill, slow on a fresh or busy instance) and a breaker probe by
``timeouts.identity_probe``; failed checks take the backend out of rotation, a passing one puts it
back. A passed check of an instance whose ``max_model_len`` is unknown, or that rejoins, also reads
it (:mod:`disagg_router.router.health.model_info`).

Identity probes (push mode, prefill instances without a configured identity): a 1-token prefill
with ``do_remote_decode: true`` makes vLLM answer with ``kv_transfer_params`` carrying its engine
id, side-channel host/port, tp and pp size. It runs with the health check at start, whenever a P
(re)joins after failing a check (a restarted vLLM is down for a while, so its new engine id is
learned as it comes back), and every ``health.identity_interval`` (default 300 s; null: never
periodically; <= ``interval``: on every check). Probes are rationed because each one costs P: it
keeps the probe's KV block until its lease expires (no D ever fetches it) and keeps P's engine
loop stepping meanwhile.
Between probes the dispatch also learns a changed engine id from any P leg's answer; both go
through :func:`disagg_router.router.instances.identity.learn_identity`, the one place an identity is
recorded.

Engine shapes (:mod:`disagg_router.router.health.shapes`): P's probe answer carries its shape (TP,
PP, block size, KV heads) when its connector speaks shapes; then each D of its pools gets an
identity probe too (a bare 1-token probe, at once when a P's shape changes and then like P's), so
the pair choice skips the pairs the connector cannot serve. Without a P that reports a shape no D is
probed (today's behaviour: every pair is assumed served).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from disagg_router.router.config import PushIdentity, RouterSettings
from disagg_router.router.errors import UpstreamError, UpstreamTimeout
from disagg_router.router.health.model_info import learn_max_model_len
from disagg_router.router.health.shapes import (
    count_refused,
    decode_probe_body,
    learn_shape,
    speaks_shapes,
    unprobed_decodes,
)
from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.identity import learn_identity
from disagg_router.router.instances.state import BackendState
from disagg_router.router.runtime import Runtime
from disagg_router.router.upstream.calls import get_ok, post_json
from disagg_router.router.upstream.rewrite import identity_from_kv, prefill_body

log = logging.getLogger(__name__)


class HealthMonitor:
    """Active checks of every backend of one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.client = runtime.client
        self.metrics = runtime.metrics
        self._refused_models: set[str] = set()  # models whose refused-pairs gauge is set

    @property
    def settings(self) -> RouterSettings:
        """The config in force now (hot reload may replace it between checks)."""
        return self.runtime.settings

    async def probe_identity(self, backend: BackendState) -> PushIdentity:
        """Ask a prefill instance who it is; raises ``UpstreamError`` or ``ValueError``."""
        rid = new_request_id()
        body = prefill_body(
            {
                "model": backend.model or self.settings.model_names[0],
                "prompt": self.settings.health.identity_prompt,
            },
            chat=False,
            transfer_id=rid,
            probe=True,
        )
        answer = await post_json(self.client, backend, "prefill", "/v1/completions", body, rid)
        kv = answer.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise ValueError("probe answer has no kv_transfer_params")
        identity = identity_from_kv(kv)
        learn_shape(backend, kv)
        return identity

    async def probe_shape(self, backend: BackendState) -> None:
        """D's identity probe (a bare 1-token probe): learns its shape, or that it has none;
        raises ``UpstreamError`` or ``ValueError`` like a leg."""
        rid = new_request_id()
        model = backend.model or self.settings.model_names[0]
        body = decode_probe_body(model, self.settings.health.identity_prompt)
        answer = await post_json(self.client, backend, "decode", "/v1/completions", body, rid)
        kv = answer.get("kv_transfer_params")
        learn_shape(backend, kv if isinstance(kv, dict) else None)
        backend.identity_learned_at = time.monotonic()

    async def _probe_decodes_of(self, prefill: BackendState) -> None:
        """Probe at once the never-probed D's paired with ``prefill`` (its shape is new); a
        failure is logged and left to that D's own checks."""
        decodes = unprobed_decodes(self.runtime.routing.table, prefill)
        bound = self.settings.timeouts.identity_probe
        results = await asyncio.gather(
            *(asyncio.wait_for(self.probe_shape(d), bound) for d in decodes),
            return_exceptions=True,
        )
        for d, result in zip(decodes, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("decode %s identity probe failed: %r", d.label, result)

    async def probe_generation(self, backend: BackendState) -> None:
        """The half-open probe: a real 1-token request (on P an identity probe, which our
        connector answers without pinning blocks); raises like a leg would."""
        if backend.role == "prefill":
            identity = await self.probe_identity(backend)
            if backend.needs_identity_probe and self.settings.mode == "push":
                learn_identity(backend, identity, self.metrics)
            return
        rid = new_request_id()
        body = {
            "model": backend.model or self.settings.model_names[0],
            "prompt": self.settings.health.identity_prompt,
            "max_tokens": 1,
        }
        await post_json(self.client, backend, "decode", "/v1/completions", body, rid)

    async def probe_breaker(self, backend: BackendState) -> bool:
        """Probe an open breaker (bounded by ``timeouts.identity_probe``); True if it passed.

        A passed probe puts the instance on trial, not back for good: the next real leg closes
        the breaker or opens it again with a longer backoff
        (:mod:`disagg_router.router.instances.breaker`)."""
        breaker = backend.breaker
        breaker.begin_probe()
        labels = (backend.role, backend.label)
        try:
            await asyncio.wait_for(
                self.probe_generation(backend), self.settings.timeouts.identity_probe
            )
        except (UpstreamError, ValueError, TimeoutError) as exc:
            breaker.record_failure(repr(exc))
            self.metrics.breaker_probes.labels(*labels, "failed").inc()
            log.warning("%s %s half-open probe failed: %r", backend.role, backend.label, exc)
            return False
        breaker.probe_passed()
        self.metrics.breaker_probes.labels(*labels, "ok").inc()
        log.info(
            "%s %s on trial (half-open probe passed; the next leg decides)",
            backend.role,
            backend.label,
        )
        return True

    async def _check(self, backend: BackendState) -> None:
        t = self.settings.timeouts
        await asyncio.wait_for(
            get_ok(self.client, backend, backend.role, "/health", new_request_id()), t.health
        )
        if backend.max_model_len is None or not backend.healthy:
            await learn_max_model_len(self.client, backend, t.health)
        if self.settings.mode != "push" or not self._probe_due(backend):
            return
        if backend.needs_identity_probe:
            shape = backend.shape
            identity = await asyncio.wait_for(self.probe_identity(backend), t.identity_probe)
            learn_identity(backend, identity, self.metrics)
            if backend.shape is not None and backend.shape != shape:
                await self._probe_decodes_of(backend)
        elif backend.role == "decode" and speaks_shapes(self.runtime.routing.table, backend):
            await asyncio.wait_for(self.probe_shape(backend), t.identity_probe)

    def _probe_due(self, backend: BackendState) -> bool:
        if not backend.healthy or backend.identity_learned_at is None:
            return True
        interval = self.settings.health.identity_interval
        return interval is not None and time.monotonic() - backend.identity_learned_at >= interval

    async def check(self, backend: BackendState) -> bool:
        """One bounded health check (and identity probe when due); updates ``backend.healthy``.

        A definite failure (refused, HTTP error, no kv params) takes the backend out at once; a
        timeout only after ``health.failure_threshold`` consecutive ones, so an instance that is
        merely slow under load does not flap out of rotation.
        """
        try:
            await self._check(backend)
        except (UpstreamError, ValueError, TimeoutError) as exc:
            backend.failed_checks += 1
            backend.last_error = repr(exc)
            unreachable = isinstance(exc, UpstreamError) and exc.unreachable
            slow = not unreachable and isinstance(exc, TimeoutError | UpstreamTimeout)
            threshold = self.settings.health.failure_threshold
            if backend.healthy and (not slow or backend.failed_checks >= threshold):
                log.warning("%s %s unhealthy: %r", backend.role, backend.label, exc)
                backend.healthy = False
        else:
            if not backend.healthy:
                log.info("%s %s healthy again", backend.role, backend.label)
            backend.healthy = True
            backend.failed_checks = 0
            backend.last_error = None
        backend.checked = True
        self.metrics.healthy.labels(backend.role, backend.label).set(1 if backend.healthy else 0)
        return backend.healthy

    async def check_all(self) -> None:
        """Check every backend of every pool concurrently."""
        await self.check_some(self.runtime.backends())

    async def check_some(self, backends: Sequence[BackendState]) -> None:
        """Check the given backends concurrently (e.g. instances that just joined a pool)."""
        await asyncio.gather(*(self.check(b) for b in backends))
        self.count_refused()

    def count_refused(self) -> None:
        """Update the refused-pairs gauge from the shapes known now."""
        table = self.runtime.routing.table
        self._refused_models = count_refused(
            table, self.metrics.refused_pairs, self._refused_models
        )

    async def run(self) -> None:
        """Check forever (cancel to stop): all backends at once first, then every backend each
        ``health.interval``; unhealthy ones (still starting, or failing) each
        ``unhealthy_interval``, so they rejoin quickly; open breakers once their backoff passed."""
        h = self.settings.health
        tick = min(h.interval, h.unhealthy_interval, self.settings.breaker.backoff)
        await self.check_all()
        self.runtime.lifecycle.initial_check_done.set()
        last_full = last_down = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            self.runtime.routing.forget_idle()
            work = [self.probe_breaker(b) for b in self.runtime.backends() if b.breaker.probe_due()]
            if now - last_full >= h.interval - tick / 2:
                last_full = last_down = now
                work += [self.check(b) for b in self.runtime.backends()]
            elif now - last_down >= h.unhealthy_interval - tick / 2:
                last_down = now
                work += [self.check(b) for b in self.runtime.backends() if not b.healthy]
            if work:
                await asyncio.gather(*work)
                self.count_refused()
