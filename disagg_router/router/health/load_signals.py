"""Live load signals of vLLM instances, scraped from their Prometheus ``/metrics``.

Who calls it: the app lifespan (:mod:`disagg_router.router.http.app`) runs :func:`run_scraper` as a
background task. It scrapes every backend of every pool whose policy reads load signals each
``load_signals.interval`` and stores the result in ``BackendState.signals`` (parsed by
:func:`disagg_router.router.instances.load.parse_signals`; policies compare them through
:func:`disagg_router.router.instances.load.backend_load`). A failed or unparsable scrape leaves no
signals (a policy then uses the router's own in-flight count); nothing here raises into a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from disagg_router.router.errors import UpstreamError
from disagg_router.router.ids import new_request_id
from disagg_router.router.instances.load import parse_signals
from disagg_router.router.instances.state import BackendState
from disagg_router.router.upstream.calls import get_ok
from disagg_router.router.upstream.client import UpstreamClient

log = logging.getLogger(__name__)


async def scrape(client: UpstreamClient, backend: BackendState, timeout: float) -> None:
    """Scrape one backend once; on any failure its signals are cleared (never raises)."""
    asked = get_ok(client, backend, backend.role, "/metrics", new_request_id())
    try:
        text = (await asyncio.wait_for(asked, timeout)).decode("utf-8", "replace")
    except (UpstreamError, TimeoutError) as exc:
        log.debug("%s %s: no load signals (%r)", backend.role, backend.label, exc)
        backend.signals = None
        return
    signals = parse_signals(text, backend.model, time.monotonic())
    if signals is not None:
        signals = replace(signals, own_in_flight=backend.in_flight)
    backend.signals = signals


async def run_scraper(
    client: UpstreamClient,
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
