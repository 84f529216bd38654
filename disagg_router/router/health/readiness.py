"""Readiness: whether the router can serve now, and what is degraded while it does.

Who calls it: the app (:mod:`disagg_router.router.http.app`): ``/ready`` (:func:`readiness`), the
``/metrics`` registry at every scrape (:class:`ReadinessCollector`, registered by the app lifespan)
and the generation endpoints before their first upstream call (:func:`await_first_check`). Nothing
here changes state.

Per model: ``ready`` with a usable D and a usable P; ``degraded`` with a usable D but no usable
P when the model's rule (``disaggregation.when_no_prefill: decode_only``) serves its requests by D
alone; ``unavailable`` otherwise, also when every usable P/D pair is one the KV connector cannot
serve (:mod:`disagg_router.router.routing.pairing`; ``refused_pairs`` lists each refused pair of
members with the reason, and each is a ``degraded`` entry). A backend is usable once checked,
healthy, its breaker admitting legs and (P in push mode) its identity known. The router is ready
(200) when no model is unavailable and it is not draining: readiness means "can serve", so a
Kubernetes readiness probe keeps the replica in rotation exactly when the fallback carries the
traffic. ``degraded`` lists what is wrong while it serves: models served by D alone, refused pairs,
failing discovery, background tasks that crashed and wait to restart, KV event streams that are
degraded (the same state as ``disagg_router_kv_stream_degraded``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from disagg_router.router.discovery.watcher import DiscoveryStatus
from disagg_router.router.routing.pairing import RefusedPair, refused_pairs
from disagg_router.router.routing.table import ModelPools
from disagg_router.router.runtime import Runtime
from disagg_router.router.supervisor import Supervisor, TaskHealth

ModelState = Literal["ready", "degraded", "unavailable"]
HEALTH_MONITOR = "health_monitor"  # the supervised name of the health monitor's task


class DiscoveryStatuses(Protocol):
    """What readiness needs of the discovery manager."""

    def status(self) -> dict[str, dict[str, DiscoveryStatus]]: ...


@dataclass(frozen=True)
class ModelReadiness:
    state: ModelState
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    refused: tuple[RefusedPair, ...] = ()


@dataclass(frozen=True)
class Readiness:
    """One assessment; ``body`` is what ``/ready`` answers."""

    ready: bool
    degraded: tuple[str, ...]
    models: Mapping[str, ModelReadiness]
    body: dict[str, object]


def _model(found: ModelPools) -> ModelReadiness:
    usable_p = [b for b in found.prefill.usable() if b.checked]
    usable_d = [b for b in found.decode.usable() if b.checked]
    p, d = tuple(b.label for b in usable_p), tuple(b.label for b in usable_d)
    fallback = found.route.disaggregation.when_no_prefill == "decode_only"
    served = len(refused_pairs(usable_p, usable_d)) < len(p) * len(d)
    state: ModelState = "unavailable"
    if d and p and served:
        state = "ready"
    elif d and not p and fallback:
        state = "degraded"
    refused = tuple(refused_pairs(found.prefill.backends, found.decode.backends))
    return ModelReadiness(state, p, d, refused)


def _degraded(
    models: Mapping[str, ModelReadiness],
    discovery: Mapping[str, Mapping[str, DiscoveryStatus]],
    tasks: Mapping[str, TaskHealth],
) -> tuple[str, ...]:
    out = [f"model {n}: no usable prefill, served by decode alone" for n, m in models.items()]
    out = [r for r, m in zip(out, models.values(), strict=True) if m.state == "degraded"]
    out += [
        f"model {n}: pair prefill {r.prefill} / decode {r.decode} refused: {r.reason}"
        for n, m in models.items()
        for r in m.refused
    ]
    out += [
        f"discovery {model}/{role}: {s.error}"
        for model, roles in discovery.items()
        for role, s in roles.items()
        if not s.ok
    ]
    out += [f"task {n}: {h.last_error}" for n, h in tasks.items() if not h.running]
    return tuple(out)


def readiness(
    runtime: Runtime,
    discovery: Mapping[str, Mapping[str, DiscoveryStatus]],
    tasks: Mapping[str, TaskHealth],
) -> Readiness:
    """The router's readiness now (see the module docstring for the rules)."""
    models = {name: _model(found) for name, found in runtime.routing.table.models.items()}
    draining = runtime.lifecycle.draining
    ready = not draining and all(m.state != "unavailable" for m in models.values())
    degraded = _degraded(models, discovery, tasks) + tuple(runtime.kv.degraded())
    first = next(iter(models.values()))  # top-level prefill/decode: the first model's
    body: dict[str, object] = {
        "ready": ready,
        "degraded": list(degraded),
        "mode": runtime.settings.mode,
        "prefill": list(first.prefill),
        "decode": list(first.decode),
        "models": {
            name: {
                "ready": m.state != "unavailable",
                "state": m.state,
                "prefill": list(m.prefill),
                "decode": list(m.decode),
            }
            for name, m in models.items()
        },
        "draining": draining,
        "refused_pairs": [
            {"model": n, "prefill": r.prefill, "decode": r.decode, "reason": r.reason}
            for n, m in models.items()
            for r in m.refused
        ],
        "missing": {
            f"{b.role} {b.label}": why
            for pool in runtime.pools
            for b in pool.backends
            if (why := b.missing(pool.require_identity)) is not None
        },
    }
    if tasks:
        body["background"] = {name: h.as_json() for name, h in sorted(tasks.items())}
    if discovery:
        body["discovery"] = {
            model: {role: state.as_json() for role, state in roles.items()}
            for model, roles in discovery.items()
        }
    return Readiness(ready, degraded, models, body)


class ReadinessCollector:
    """Readiness as metrics, computed at scrape time: ``disagg_router_ready``,
    ``disagg_router_degraded``, ``disagg_router_model_degraded{model}`` and
    ``disagg_router_background_task_up{task}``. Register once per app run; unregister at its
    end."""

    def __init__(
        self, runtime: Runtime, supervisor: Supervisor, discovery: DiscoveryStatuses | None = None
    ) -> None:
        self._runtime = runtime
        self._supervisor = supervisor
        self._discovery = discovery

    def collect(self) -> Iterator[Metric]:
        found = self._discovery.status() if self._discovery is not None else {}
        tasks = self._supervisor.status()
        now = readiness(self._runtime, found, tasks)
        yield GaugeMetricFamily(
            "disagg_router_ready",
            "1 when /ready answers 200 (every model can be served)",
            value=1 if now.ready else 0,
        )
        yield GaugeMetricFamily(
            "disagg_router_degraded",
            "1 while the router serves in a degraded state (see /ready's degraded list)",
            value=1 if now.degraded else 0,
        )
        per_model = GaugeMetricFamily(
            "disagg_router_model_degraded",
            "1 while the model has no usable prefill and is served by decode alone",
            labels=["model"],
        )
        for name, m in now.models.items():
            per_model.add_metric([name], 1 if m.state == "degraded" else 0)
        yield per_model
        up = GaugeMetricFamily(
            "disagg_router_background_task_up",
            "1 while the supervised background task runs, 0 while it waits to restart",
            labels=["task"],
        )
        for name, h in sorted(tasks.items()):
            up.add_metric([name], 1 if h.running else 0)
        yield up


async def await_first_check(runtime: Runtime, supervisor: Supervisor | None) -> None:
    """Wait until the health monitor's first check of every backend has finished, at most
    ``health.startup_wait`` seconds, and not at all once the monitor has crashed."""
    done = runtime.lifecycle.initial_check_done
    if done.is_set():
        return
    waits = {asyncio.ensure_future(done.wait())}
    if supervisor is not None:
        waits.add(asyncio.ensure_future(supervisor.crashed(HEALTH_MONITOR).wait()))
    try:
        await asyncio.wait(
            waits, timeout=runtime.settings.health.startup_wait, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for w in waits:
            w.cancel()
