"""Dispatches on one event loop over scripted P and D instances: what happens between choosing the
pair and the legs' first bytes, and which pair a retry takes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from disagg_router.router.config import AdmissionConfig, InstanceConfig, settings_from_mapping
from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.orchestrator import open_dispatch
from disagg_router.router.instances.admission import Gate
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.request import ClientRequest
from disagg_router.router.runtime import open_runtime
from tests.support.scripted import scripted
from tests.unit.router.mock_upstream import KV, answer

IDENTITY = {"engine_id": "eng", "host": "127.0.0.1", "port": 5600}
PREFILLS = [f"http://127.0.0.1:{9201 + i}" for i in range(3)]
DECODE = "http://127.0.0.1:9301"
"""Instances of the admission tests, which make no call."""


async def test_a_burst_with_one_prefix_keeps_every_prefill_within_the_load_bound() -> None:
    """30 dispatches with one prefix opened at once (every choice made before any leg starts)
    over 3 P: ``ceil(1.25 * 30 / 3) = 13`` holds for each P."""
    legs: Counter[str] = Counter()
    decode_port = 0

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.port != decode_port:
            legs[str(request.url.port)] += 1
        return httpx.Response(200, json=answer("a", KV))

    body = {"model": "m", "prompt": "one shared prefix " * 30, "max_tokens": 2}
    request = ClientRequest(body=body, chat=False, stream=False, model="m")
    with scripted(upstream, 4) as servers:
        decode_port = servers[3].port
        settings = settings_from_mapping(
            {
                "models": ["m"],
                "prefill": {
                    "instances": [{"url": s.url, "identity": IDENTITY} for s in servers[:3]],
                    "policy": "prefix_affinity",
                },
                "decode": {"instances": [{"url": servers[3].url}]},
            }
        )
        async with open_runtime(settings) as runtime:
            opened = await asyncio.gather(*(open_dispatch(runtime, request) for _ in range(30)))
            for dispatch in opened:
                await dispatch.close()
            in_flight = [b.in_flight for pool in runtime.pools for b in pool.backends]
    assert sum(legs.values()) == 30, json.dumps(legs)
    assert max(legs.values()) <= 13, legs
    assert in_flight == [0, 0, 0, 0]  # every count taken by a choice was given back


@pytest.mark.parametrize("failing", ["dead decode", "decode answering 503", "prefill"])
async def test_a_retry_after_a_dead_d_keeps_p_and_after_any_other_failure_takes_a_fresh_pair(
    failing: str,
) -> None:
    """2P2D, round robin: the first attempt's D is gone (its port refuses), or D or P answers
    503. After the dead D the retry goes to the same P (its prefix cache holds the prompt) and
    the other D; after an error answer (which may be P's doing when D's), to the other P. The
    client's request succeeds every time."""
    legs: list[tuple[str, int | None]] = []
    bad: set[int | None] = set()

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        role = "prefill" if body["kv_transfer_params"].get("do_remote_decode") else "decode"
        legs.append((role, request.url.port))
        if request.url.port in bad:
            return httpx.Response(503, json={"error": {"message": "engine dead"}})
        return httpx.Response(200, json=answer("a", KV if role == "prefill" else None))

    body = {"model": "m", "prompt": "a long prompt " * 20, "max_tokens": 2}
    request = ClientRequest(body=body, chat=False, stream=False, model="m")
    with scripted(upstream, 4) as servers:
        p_ports, d_ports = [s.port for s in servers[:2]], [s.port for s in servers[2:]]
        pools = {
            "prefill": {
                "instances": [{"url": s.url, "identity": IDENTITY} for s in servers[:2]],
                "policy": "round_robin",
            },
            "decode": {"instances": [{"url": s.url} for s in servers[2:]], "policy": "round_robin"},
        }
        settings = settings_from_mapping({"models": ["m"], "mode": "pull", **pools})
        # round robin's first choices are p0 and d0
        if failing == "dead decode":
            servers[2].stop()  # its port refuses connections
        else:
            bad.add(p_ports[0] if failing == "prefill" else d_ports[0])
        async with open_runtime(settings) as runtime:
            dispatch = await open_dispatch(runtime, request)
            await dispatch.close()
            registry: CollectorRegistry = runtime.metrics.registry
            failovers = {
                kept: registry.get_sample_value(
                    "disagg_router_decode_failovers_total",
                    {"phase": "before_first_token", "prefill": kept},
                )
                for kept in ("kept", "other")
            }
    gone = 1.0 if failing == "dead decode" else None
    assert failovers == {"kept": gone, "other": None}
    prefills = [port for role, port in legs if role == "prefill"]
    decodes = [port for role, port in legs if role == "decode"]
    if failing == "dead decode":
        assert prefills == [p_ports[0], p_ports[0]]  # the retry kept P
        assert decodes == [d_ports[1]]  # d0 never answered
    elif failing == "decode answering 503":
        assert prefills == [p_ports[0], p_ports[1]]
        assert decodes == [d_ports[0], d_ports[1]]
    else:
        assert prefills == [p_ports[0], p_ports[1]]
        assert len(decodes) == 1


def _pair(max_in_flight: int = 1) -> tuple[BackendState, BackendState]:
    admission = AdmissionConfig(max_in_flight=max_in_flight, queue_size=4, max_wait=30)
    return tuple(  # type: ignore[return-value]
        BackendState(InstanceConfig(url=u), role=r, gate=Gate(admission), in_flight=1)
        for u, r in ((PREFILLS[0], "prefill"), (DECODE, "decode"))
    )


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0)  # yield to the admitting task; no time passes


@pytest.mark.parametrize("full_role", ["prefill", "decode"])
async def test_admission_waits_for_the_full_instance_holding_no_slot_on_the_other(
    full_role: str,
) -> None:
    p, d = _pair()
    full, other = (p, d) if full_role == "prefill" else (d, p)
    held, _ = await full.gate.acquire(full.label)
    holds = Holds(RouterMetrics(CollectorRegistry()), [p, d])
    admitting = asyncio.create_task(holds.admit())
    await _until(lambda: full.gate.waiting == 1)
    assert other.gate.in_use == 0  # nothing held on the free instance meanwhile
    held.release()
    await admitting
    assert (p.gate.in_use, d.gate.in_use) == (1, 1)
    holds.release_all()
    assert (p.gate.in_use, d.gate.in_use, p.in_flight, d.in_flight) == (0, 0, 0, 0)


async def test_a_slot_won_while_the_other_filled_up_is_given_back() -> None:
    """P frees up while D has filled: the dispatch gives P's slot back and waits for D."""
    p, d = _pair()
    p_held, _ = await p.gate.acquire(p.label)
    holds = Holds(RouterMetrics(CollectorRegistry()), [p, d])
    admitting = asyncio.create_task(holds.admit())
    await _until(lambda: p.gate.waiting == 1)
    d_held, _ = await d.gate.acquire(d.label)
    p_held.release()
    await _until(lambda: d.gate.waiting == 1)
    assert p.gate.in_use == 0
    d_held.release()
    await admitting
    assert (p.gate.in_use, d.gate.in_use) == (1, 1)
    holds.release_all()


async def _dies() -> AsyncIterator[bytes]:
    """An answer body that breaks its connection (an engine that died) before its first byte."""
    raise ConnectionResetError("the engine died")
    yield b""  # pragma: no cover  # makes this an async generator


async def test_a_retry_after_d_went_away_mid_prefill_lets_that_prefill_finish_first() -> None:
    """1P2D, push: D0's connection breaks while P is still prefilling. The dispatch does not
    cancel that prefill (a retry would have to compute the rest again): the retry's P leg goes
    out once the first one has answered, so P's prefix cache holds the whole prompt for it."""
    order: list[str] = []
    runtimes: list[Any] = []

    def d0_failed() -> bool:
        return bool(runtimes and runtimes[0].pools[1].backends[0].breaker.failures)

    async def until(condition: Callable[[], bool]) -> None:
        while not condition():  # polls what the router or P has done, bounded by the test
            await asyncio.sleep(0.01)

    async def upstream(request: httpx.Request) -> httpx.Response:
        kv = json.loads(request.content)["kv_transfer_params"]
        if kv.get("identity_probe"):
            return httpx.Response(200, json=answer("a", KV))
        if not kv.get("do_remote_decode"):  # a D leg
            if request.url.port == d0_port:
                await until(lambda: "P start 0" in order)
                return httpx.Response(200, content=_dies())  # the connection breaks
            return httpx.Response(200, json=answer("a", None))
        n = sum(1 for e in order if e.startswith("P start"))
        order.append(f"P start {n}")
        if n == 0:
            await until(d0_failed)
        order.append(f"P end {n}")
        return httpx.Response(200, json=answer("a", KV))

    body = {"model": "m", "prompt": "a long prompt " * 20, "max_tokens": 2}
    request = ClientRequest(body=body, chat=False, stream=False, model="m")
    with scripted(upstream, 3) as servers:
        d0_port = servers[1].port
        settings = settings_from_mapping(
            {
                "models": ["m"],
                "prefill": {"instances": [{"url": servers[0].url, "identity": IDENTITY}]},
                "decode": {
                    "instances": [{"url": s.url} for s in servers[1:]],
                    "policy": "round_robin",
                },
            }
        )
        async with open_runtime(settings) as runtime:
            runtimes.append(runtime)
            dispatch = await asyncio.wait_for(open_dispatch(runtime, request), timeout=30)
            await dispatch.close()
    assert order == ["P start 0", "P end 0", "P start 1", "P end 1"]
