"""Dispatches on one event loop over mock P and D instances (no servers): what happens between
choosing the pair and the legs' first bytes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx

from router.config import settings_from_mapping
from router.dispatch.orchestrator import open_dispatch
from router.http.validation import ClientRequest
from router.runtime import open_runtime
from tests.unit.router.mock_upstream import KV, answer

IDENTITY = {"engine_id": "eng", "host": "127.0.0.1", "port": 5600}
PREFILLS = [f"http://127.0.0.1:{9201 + i}" for i in range(3)]
DECODE = "http://127.0.0.1:9301"


async def test_a_burst_with_one_prefix_keeps_every_prefill_within_the_load_bound() -> None:
    """30 dispatches with one prefix opened at once (every choice made before any leg starts)
    over 3 P: ``ceil(1.25 * 30 / 3) = 13`` holds for each P."""
    legs: Counter[str] = Counter()

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.port != 9301:
            legs[str(request.url.port)] += 1
        return httpx.Response(200, json=answer("a", KV))

    settings = settings_from_mapping(
        {
            "models": ["m"],
            "prefill": {
                "instances": [{"url": u, "identity": IDENTITY} for u in PREFILLS],
                "policy": "prefix_affinity",
            },
            "decode": {"instances": [{"url": DECODE}]},
        }
    )
    body = {"model": "m", "prompt": "one shared prefix " * 30, "max_tokens": 2}
    request = ClientRequest(body=body, chat=False, stream=False, model="m")
    async with open_runtime(settings, httpx.MockTransport(upstream)) as runtime:
        opened = await asyncio.gather(*(open_dispatch(runtime, request) for _ in range(30)))
        for dispatch in opened:
            await dispatch.close()
        in_flight = [b.in_flight for pool in runtime.pools for b in pool.backends]
    assert sum(legs.values()) == 30, json.dumps(legs)
    assert max(legs.values()) <= 13, legs
    assert in_flight == [0, 0, 0, 0]  # every count taken by a choice was given back
