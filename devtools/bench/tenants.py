"""Tenants on real vLLM CPU: a noisy neighbour, priority under saturation, a token limit.

Who calls it: ``disagg-bench tenants`` (:mod:`bench.tenants_cmd`; wrap it in ``flock
/tmp/vllm-e2e.lock``). One 1P1D stack of our connector (P on core 0, D on core 1), one router
whose admission holds ``max_in_flight`` legs per instance, so the queue forms in the router where
tenants are ordered, ``reserved_for_high`` of them for the high class. Capacity first: the
stack's requests per second with every slot the normal class may take busy. Then
per repetition, the same victim arrivals (Poisson) for each point:

- ``alone``: the victim at ``victim_fraction`` of its share (its ``requests_per_minute``,
  ``share`` of capacity);
- ``neighbour``: the same, beside a tenant of the same share offering exactly its share (what
  the victim must live with whatever the router does);
- ``noisy``: the same, beside that tenant offering ``noisy_factor`` times its share: the victim's
  p99 TTFT against ``alone``'s and ``neighbour``'s, and how much the noisy tenant got;
- ``light``/``saturated``: a high-priority tenant at the victim's rate, alone, then beside a
  low-priority tenant without limits offering ``saturation`` times capacity.

Last, the token limit: a greedy tenant (``tokens_per_minute``, non-streamed requests, waiting
``Retry-After`` after a 429) for ``token_run_s`` seconds; the tokens its answers report for the
requests it sent in the minute before the end, against the limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, RunResult, make_client, run_load
from bench.metrics import rounded_ratio
from bench.routers import our_router
from devstack.ports import free_port
from devstack.stack import Stack, StackOptions, start_stack
from disagg_router.router.config import TenancyConfig

VICTIM_POINTS = ("alone", "neighbour", "noisy")
POINTS = (*VICTIM_POINTS, "light", "saturated")
BURST_S = TenancyConfig().burst
"""The routers' ``tenancy.burst`` (the default)."""
KEYS = {name: f"sk-bench-{name}" for name in ("victim", "noisy", "high", "bulk", "metered")}


@dataclass(frozen=True)
class TenantsSpec:
    """What ``disagg-bench tenants`` runs."""

    input_len: int = 256
    output_len: int = 16
    requests: int = 60
    """Victim (and high-priority) requests per point."""
    share: float = 0.25
    """A tenant's share of capacity: its requests_per_minute."""
    victim_fraction: float = 0.8
    noisy_factor: float = 5.0
    saturation: float = 2.0
    max_in_flight: int = 4
    reserved_for_high: int = 1
    max_wait_s: float = 20.0
    repetitions: int = 2
    token_share: float = 0.3
    """The metered tenant's tokens_per_minute, as a share of the stack's token capacity."""
    token_run_s: float = 120.0
    seed: int = 0


@dataclass
class Point:
    """One point of one repetition: each tenant's records."""

    name: str
    rep: int
    rates: dict[str, float]
    ttft_ms: dict[str, list[float]]
    ok: dict[str, int]
    refused: dict[str, int]
    duration_s: float


def run_tenants_benchmark(spec: TenantsSpec, work_dir: Path) -> dict[str, Any]:
    """Start the stack, run every point, stop the stack; the result (:func:`summarize`)."""
    options = StackOptions(kind="ours", topology="1p1d", enforce_eager=True, max_model_len=2048)
    stack = start_stack(options, work_dir)
    try:
        stack.warm_up()  # vLLM CPU: a D whose first forward pass reads transferred KV dies
        return asyncio.run(_run(spec, stack, work_dir))
    finally:
        stack.stop()


def _tenancy(spec: TenantsSpec, capacity: float) -> dict[str, Any]:
    rpm = max(round(spec.share * capacity * 60), 1)
    tokens = max(round(spec.token_share * capacity * 60 * (spec.input_len + spec.output_len)), 1)

    def tenant(name: str, **limits: Any) -> dict[str, Any]:
        digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
        return {"name": name, "key_sha256": [digest], **limits}

    return {
        "tenants": [
            tenant("victim", requests_per_minute=rpm),
            tenant("noisy", requests_per_minute=rpm),
            tenant("high", priority="high"),
            tenant("bulk", priority="low"),
            tenant("metered", tokens_per_minute=tokens),
        ],
        "max_priority_wait": spec.max_wait_s,
    }


async def _run(spec: TenantsSpec, stack: Stack, work_dir: Path) -> dict[str, Any]:
    n = spec.requests
    prompts = make_token_prompts(
        SyntheticSpec(8 * n, spec.input_len, spec.output_len, seed=spec.seed)
    )
    config = stack.router_config(with_identity=True, health_interval_s=30.0)
    config["admission"] = {
        "max_in_flight": spec.max_in_flight,
        "reserved_for_high": spec.reserved_for_high,
        "queue_size": 4096,
        "max_wait": spec.max_wait_s,
    }
    port = free_port()
    logs = work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    async with make_client() as client:
        with our_router(config, port, logs):
            capacity = await _capacity(client, stack, url, prompts[:n])
        config["tenancy"] = _tenancy(spec, capacity)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        points: list[Point] = []
        with our_router(config, port, logs):
            for rep in range(spec.repetitions):
                for name in POINTS:
                    point = await _point(client, stack, url, spec, capacity, name, rep, prompts)
                    points.append(point)
                    print(_line(point), flush=True)
            metered = await _greedy(client, stack, url, spec, prompts)
    return summarize(spec, capacity, config["tenancy"], points, metered)


async def _capacity(
    client: httpx.AsyncClient, stack: Stack, url: str, prompts: list[BenchRequest]
) -> float:
    """Requests per second through the router with every admission slot busy (no tenants)."""
    target = Target(url, stack.model_name)
    await run_load(client, target, prompts[:4], LoadSpec(max_concurrency=1, show_progress=False))
    result = await run_load(
        client, target, prompts, LoadSpec(max_concurrency=8, show_progress=False)
    )
    return result.metrics.completed / result.metrics.duration_s


def _target(stack: Stack, url: str, who: str) -> Target:
    return Target(url, stack.model_name, headers=(("Authorization", f"Bearer {KEYS[who]}"),))


async def _point(
    client: httpx.AsyncClient,
    stack: Stack,
    url: str,
    spec: TenantsSpec,
    capacity: float,
    name: str,
    rep: int,
    prompts: list[BenchRequest],
) -> Point:
    """One point: the foreground tenant's arrivals (the same in every point of a repetition)
    and, for ``noisy``/``saturated``, the background tenant's, until the foreground is done."""
    n = spec.requests
    rate = spec.victim_fraction * spec.share * capacity
    fore = "victim" if name in VICTIM_POINTS else "high"
    back = {"neighbour": "noisy", "noisy": "noisy", "saturated": "bulk"}.get(name)
    back_rate = {
        "neighbour": spec.share * capacity,
        "noisy": spec.noisy_factor * spec.share * capacity,
        "saturated": spec.saturation * capacity,
    }.get(name, 0.0)
    rates = {fore: rate, **({back: back_rate} if back else {})}
    seed = spec.seed + rep
    fg_load = LoadSpec(request_rate=rate, seed=seed, show_progress=False)
    results: dict[str, RunResult] = {}
    bg: asyncio.Task[RunResult] | None = None
    if back is not None:
        # The background tenant starts a burst's worth of seconds early: its burst is spent
        # when the foreground's arrivals begin (a neighbour that has been noisy for a while).
        lead, span = BURST_S + 1.0, n / rate
        count = int(back_rate * (lead + span)) + 1
        background = (prompts[n:] * (count // len(prompts[n:]) + 1))[:count]
        load = LoadSpec(
            request_rate=back_rate,
            seed=seed + 1000,
            show_progress=False,
            time_limit_s=lead + span,
        )
        bg = asyncio.create_task(run_load(client, _target(stack, url, back), background, load))
        await asyncio.sleep(lead)
    start = time.perf_counter()
    results[fore] = await run_load(client, _target(stack, url, fore), prompts[:n], fg_load)
    end = time.perf_counter()
    if bg is not None and back is not None:
        results[back] = await bg
    # Each tenant's requests sent while the foreground's arrivals ran, and those it had
    # answered in that time (a backlog's included).
    during = {
        t: [r for r in res.records if start <= r.start_time <= end] for t, res in results.items()
    }
    served = {
        t: sum(r.success and start <= r.start_time + r.latency <= end for r in res.records)
        for t, res in results.items()
    }
    return Point(
        name=name,
        rep=rep,
        rates=rates,
        ttft_ms={t: [1000 * r.ttft for r in rs if r.success] for t, rs in during.items()},
        ok=served,
        refused={t: sum("HTTP 429" in r.error for r in rs) for t, rs in during.items()},
        duration_s=end - start,
    )


async def _greedy(
    client: httpx.AsyncClient, stack: Stack, url: str, spec: TenantsSpec, prompts: list[Any]
) -> dict[str, Any]:
    """The metered tenant sends one request after another for ``token_run_s`` seconds,
    waiting ``Retry-After`` after a 429; (sent at, tokens its answer reports) per request."""
    headers = {"Authorization": f"Bearer {KEYS['metered']}"}
    sent: list[tuple[float, int]] = []
    refusals = 0
    start = time.perf_counter()
    i = 0
    while (now := time.perf_counter() - start) < spec.token_run_s:
        prompt = prompts[i % len(prompts)]
        i += 1
        body = {
            "model": stack.model_name,
            "prompt": list(prompt.prompt),
            "max_tokens": spec.output_len,
            "ignore_eos": True,
        }
        resp = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        if resp.status_code == 429:
            refusals += 1
            wait = min(float(resp.headers.get("retry-after", "1")), spec.token_run_s - now)
            await asyncio.sleep(max(wait, 0.0))
            continue
        usage = resp.json().get("usage", {})
        used = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        sent.append((now, used))
    return {"sent": sent, "refusals": refusals, "run_s": spec.token_run_s}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _line(p: Point) -> str:
    parts = [
        f"{t} {p.rates[t]:.2f}/s ok {p.ok[t]} 429 {p.refused[t]} p99 {_p99(p.ttft_ms[t]):.0f} ms"
        for t in p.rates
    ]
    return f"rep {p.rep} {p.name:9s} " + " | ".join(parts)


def summarize(
    spec: TenantsSpec,
    capacity: float,
    tenancy: dict[str, Any],
    points: list[Point],
    metered: dict[str, Any],
) -> dict[str, Any]:
    """Per point: each tenant's TTFT p50/p99 (mean and spread over repetitions), admitted and
    refused; the summary keys (:data:`bench.report.TENANT_KEYS`)."""
    table: dict[str, dict[str, Any]] = {}
    for name in POINTS:
        mine = [p for p in points if p.name == name]
        for tenant in mine[0].rates if mine else ():
            p99s = [_p99(p.ttft_ms[tenant]) for p in mine]
            table[f"{name}/{tenant}"] = {
                "rate_rps": mine[0].rates[tenant],
                "ttft_p50_ms": statistics.mean(
                    statistics.median(p.ttft_ms[tenant]) if p.ttft_ms[tenant] else 0.0 for p in mine
                ),
                "ttft_p99_ms": statistics.mean(p99s),
                "ttft_p99_low_ms": min(p99s),
                "ttft_p99_high_ms": max(p99s),
                "admitted_rps": statistics.mean(p.ok[tenant] / p.duration_s for p in mine),
                "refused": sum(p.refused[tenant] for p in mine),
            }
    limit = next(t["tokens_per_minute"] for t in tenancy["tenants"] if t["name"] == "metered")
    end = metered["run_s"]
    last_minute = sum(tokens for at, tokens in metered["sent"] if end - 60.0 <= at < end)
    rpm = next(t["requests_per_minute"] for t in tenancy["tenants"] if t["name"] == "noisy")
    return {
        "spec": asdict(spec),
        "capacity_rps": capacity,
        "limits": {"requests_per_minute": rpm, "tokens_per_minute": limit},
        "table": table,
        "tokens": {
            "limit_per_minute": limit,
            "last_minute": last_minute,
            "refusals": metered["refusals"],
        },
        "summary": _keys(table, rpm, limit, last_minute),
        "points": [asdict(p) for p in points],
    }


def _keys(table: dict[str, dict[str, Any]], rpm: int, limit: int, measured: int) -> dict[str, Any]:
    def cell(name: str, key: str) -> float:
        return float(table.get(name, {}).get(key, 0.0))

    return {
        "victim_p99_ttft_noisy_over_alone": rounded_ratio(
            cell("noisy/victim", "ttft_p99_ms"), cell("alone/victim", "ttft_p99_ms")
        ),
        "victim_p99_ttft_noisy_over_neighbour_at_share": rounded_ratio(
            cell("noisy/victim", "ttft_p99_ms"), cell("neighbour/victim", "ttft_p99_ms")
        ),
        "noisy_admitted_over_share": rounded_ratio(cell("noisy/noisy", "admitted_rps") * 60, rpm),
        "priority_p99_ttft_saturated_over_light": rounded_ratio(
            cell("saturated/high", "ttft_p99_ms"), cell("light/high", "ttft_p99_ms")
        ),
        "token_limit_error": round(abs(measured - limit) / limit, 4) if limit else None,
    }
