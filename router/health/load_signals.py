"""Live load signals of vLLM instances, scraped from their Prometheus ``/metrics``.

Who calls it: the app lifespan (:mod:`router.http.app`) runs :func:`run_scraper` as a background
task; it scrapes every
backend of every pool whose policy is ``power_of_two`` each ``load_signals.interval`` and stores
the result in ``BackendState.signals``. The ``power_of_two`` policy reads them through
:func:`backend_load`. A failed or unparsable scrape leaves no signals (the policy then uses the
router's own in-flight count); nothing here raises into a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.dispatch.ids import new_request_id
from router.routing.backends import BackendState, LoadSignals
from router.upstream.calls import leg_headers

log = logging.getLogger(__name__)

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_signals(text: str, model: str, at: float) -> LoadSignals | None:
    """The signals for ``model`` in a vLLM ``/metrics`` page (summed over its engines).

    Samples whose ``model_name`` label differs from ``model`` are ignored (when ``model`` is
    empty, all count). None when the page has neither request gauge or does not parse.
    """
    sums = {_WAITING: 0.0, _RUNNING: 0.0, _KV_USAGE: 0.0}
    seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in sums:
                    continue
                if model and sample.labels.get("model_name", model) != model:
                    continue
                sums[sample.name] += sample.value
                seen.add(sample.name)
    except ValueError:
        return None
    if _WAITING not in seen and _RUNNING not in seen:
        return None
    return LoadSignals(sums[_WAITING], sums[_RUNNING], min(sums[_KV_USAGE], 1.0), at)


def backend_load(backend: BackendState, now: float, stale_after: float) -> float:
    """The load ``power_of_two`` compares: this router's legs in flight now, plus the requests
    vLLM reported beyond this router's own at the last scrape, plus KV cache usage.

    With fresh signals: ``in_flight + max(0, running + waiting - own_in_flight_at_scrape) +
    kv_usage``. The middle term is the load other routers (or clients) put on the instance; this
    router's own share is always the live count, never a stale one, so choices do not herd onto
    one instance between two scrapes. KV usage (0..1) breaks ties toward the emptier cache.
    Stale (older than ``stale_after``) or missing signals: ``in_flight`` alone.
    """
    s = backend.signals
    if s is None or now - s.at > stale_after:
        return float(backend.in_flight)
    others = max(0.0, s.running + s.waiting - s.own_in_flight)
    return backend.in_flight + others + s.kv_usage


async def scrape(client: httpx.AsyncClient, backend: BackendState, timeout: float) -> None:
    """Scrape one backend once; on any failure its signals are cleared (never raises)."""
    headers = leg_headers(client, backend, new_request_id())
    try:
        resp = await asyncio.wait_for(
            client.get(backend.url + "/metrics", headers=headers), timeout
        )
        resp.raise_for_status()
    except (httpx.HTTPError, TimeoutError) as exc:
        log.debug("%s %s: no load signals (%r)", backend.role, backend.label, exc)
        backend.signals = None
        return
    signals = parse_signals(resp.text, backend.model, time.monotonic())
    if signals is not None:
        signals = replace(signals, own_in_flight=backend.in_flight)
    backend.signals = signals


async def run_scraper(
    client: httpx.AsyncClient,
    targets: Callable[[], Iterable[BackendState]],
    interval: Callable[[], float],
    timeout: float,
) -> None:
    """Scrape ``targets()`` concurrently every ``interval()`` seconds, forever (cancel to stop).

    Both are re-read each round, so a reloaded config takes effect at the next round.
    """
    while True:
        await asyncio.gather(*(scrape(client, b, timeout) for b in targets()))
        await asyncio.sleep(interval())
