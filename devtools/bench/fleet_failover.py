"""D failover at fleet scale on emulated engines: Ds killed one after another under streamed
load, every stream whole or not, and what a stream that lost its D paid to go on.

Who calls it: ``disagg-bench fleet-failover`` (:mod:`bench.fleet_failover_cmd`). It starts an
emulated xPyD fleet (``python -m devstack.emulator`` on the first core) and our router over it
(the last core: push, eager binding, stream migration on as by default, P and D by fewest legs in
flight, health checked every second), then offers ``requests`` Poisson streams of new
``input_len``-token prompts at ``loaded_fraction`` of the fleet's prefill capacity (the profile
gives it). While they run, ``kills`` Ds, chosen at random, are killed at even intervals over the
arrivals (``DELETE /members/{name}``: the engine drops its connections as a dead process's would;
the router is not told). From the client: every stream whole or not (``[DONE]``, ``output_len``
tokens, no error event); for the streams whose dispatch was in flight on a killed D, the longest
gap between two of their tokens (the time to resume), beside the median TTFT of the run's streams
(what a full retry at that load would wait for its first token). From the router's ``/metrics``:
migrations by outcome, D failovers by phase, and the prompt tokens P computed for each attempt
after a D failure.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.emulated_stack import (
    FleetSetup,
    RunningFleet,
    fewest_in_flight_config,
    fleet_behind_router,
)
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import RequestRecord, percentile, rounded_ratio
from bench.routers import leg_timeouts
from bench.scrapes import Samples, by_label, scrape
from devstack.emulator.profile import load_profile

COMPUTED = "disagg_router_failover_prefill_computed_tokens"


@dataclass(frozen=True)
class FleetFailoverSpec:
    """The fleet (``size`` P and as many D of ``profile``), the streams and the kills."""

    size: int = 16
    profile: str = "h200-qwen3-32b-tp1"
    input_len: int = 8192
    output_len: int = 256
    loaded_fraction: float = 0.5
    requests: int = 320
    kills: int = 4
    seed: int = 0
    ready_timeout_s: float = 180.0

    def rate(self) -> float:
        """Requests per second that keep every P ``loaded_fraction`` busy."""
        per_p = load_profile(self.profile).prefill_seconds(self.input_len)
        return self.loaded_fraction * self.size / per_p

    def kill_times(self) -> list[float]:
        """Seconds after the first arrival at which a D is killed: even intervals over the
        arrivals, none at their ends."""
        span = self.requests / self.rate()
        return [span * (k + 1) / (self.kills + 1) for k in range(self.kills)]


@dataclass(frozen=True)
class Kill:
    name: str
    at_s: float
    in_flight: tuple[str, ...]
    """The dispatch ids the engine had in flight when it died."""


def run_fleet_failover(spec: FleetFailoverSpec, work: Path) -> dict[str, Any]:
    """Start, load and kill, stop; the figures and the summary keys."""
    if spec.kills >= spec.size:
        raise ValueError(f"kills must be below size ({spec.size}), got {spec.kills}")
    profile = load_profile(spec.profile)
    prompts = make_token_prompts(
        SyntheticSpec(spec.requests, spec.input_len, spec.output_len, seed=spec.seed)
    )
    setup = FleetSetup(spec.size, spec.size, spec.profile)
    # health checked every second; stream migration and the retry on a fresh pair are on by
    # default
    config = partial(
        fewest_in_flight_config,
        model=profile.model,
        health={"interval": 1.0},
        timeouts=leg_timeouts(300.0),
    )
    timeout = spec.ready_timeout_s
    with fleet_behind_router(setup, config, work, timeout, log_level="info") as fleet:
        victims = [d["name"] for d in fleet.instances["decode"]]
        random.Random(spec.seed).shuffle(victims)
        records, kills, after = asyncio.run(
            _measure(fleet, profile.model, prompts, spec, victims[: spec.kills])
        )
    return {"spec": asdict(spec), "rate": spec.rate(), **figures(records, kills, after, spec)}


async def _measure(
    fleet: RunningFleet,
    model: str,
    prompts: list[BenchRequest],
    spec: FleetFailoverSpec,
    victims: list[str],
) -> tuple[list[RequestRecord], list[Kill], Samples]:
    load = LoadSpec(request_rate=spec.rate(), seed=spec.seed, show_progress=False)
    target = Target(fleet.router_url, model)
    async with make_client() as client:
        loading = asyncio.create_task(run_load(client, target, prompts, load))
        kills = await _kill(client, fleet.control_url, victims, spec.kill_times())
        result = await loading
        after = (await scrape(client, {"router": fleet.router_url}))["router"]
    return list(result.records), kills, after


async def _kill(
    client: httpx.AsyncClient, control: str, victims: list[str], times: list[float]
) -> list[Kill]:
    """Kill ``victims[i]`` ``times[i]`` seconds from now; what each had in flight."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    kills = []
    for name, at in zip(victims, times, strict=True):
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        answer = await client.delete(f"{control}/members/{name}", timeout=30.0)
        answer.raise_for_status()
        kills.append(Kill(name, loop.time() - start, tuple(answer.json()["in_flight"])))
    return kills


def figures(
    records: list[RequestRecord], kills: list[Kill], router: Samples, spec: FleetFailoverSpec
) -> dict[str, Any]:
    """The client's and the router's figures of one run, and the summary keys."""
    whole = {id(r) for r in records if r.success and r.output_tokens == spec.output_len}
    hit = {rid for k in kills for rid in k.in_flight}
    on_killed = [r for r in records if r.request_id in hit]
    resumed = [max(r.itl) for r in on_killed if r.success and r.itl]
    ttft = [r.ttft for r in records if r.success]
    resume_p50 = percentile(resumed, 50)
    ttft_p50 = percentile(ttft, 50)
    migrations = _counts(router, "disagg_router_stream_migrations_total", "outcome")
    computed = {p: _bucket_bound(router, COMPUTED, p) for p in _phases(router)}
    most = computed.get("after_first_token", {}).get("at_most", 0.0)
    fleet = f"{spec.size}p{spec.size}d"
    return {
        "streams": len(records),
        "whole": len(whole),
        "not_whole": [_failure(r) for r in records if id(r) not in whole][:20],
        "kills": [asdict(k) | {"in_flight": len(k.in_flight)} for k in kills],
        "on_killed": len(on_killed),
        "on_killed_whole": sum(1 for r in on_killed if id(r) in whole),
        "resume_s": {"p50": resume_p50, "max": max(resumed, default=0.0), "count": len(resumed)},
        "ttft_p50_s": ttft_p50,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
        "migrations": migrations,
        "failovers": _counts(router, "disagg_router_decode_failovers_total", "phase"),
        "p_computed_tokens": computed,
        "summary": {
            f"migration_completed_fraction_{fleet}_emulated": rounded_ratio(
                len(whole), len(records)
            ),
            f"migration_resume_over_full_retry_{fleet}_emulated": rounded_ratio(
                resume_p50, ttft_p50
            ),
            f"migration_p_prompt_tokens_max_{fleet}_emulated": most,
        },
    }


def _failure(record: RequestRecord) -> dict[str, Any]:
    return {"id": record.request_id, "tokens": record.output_tokens, "error": record.error[:200]}


def _counts(samples: Samples, series: str, label: str) -> dict[str, float]:
    """A counter of a fresh router per value of ``label``."""
    return by_label({}, {"router": samples}, "router", series, label)


def _phases(samples: Samples) -> list[str]:
    return sorted({labels["phase"] for _, labels, _ in samples.get(f"{COMPUTED}_count", [])})


def _bucket_bound(samples: Samples, family: str, phase: str) -> dict[str, float]:
    """A fresh router's histogram of one phase: observations, their mean, and the smallest
    bucket edge that holds them all (``at_most``)."""

    def one(series: str) -> list[tuple[dict[str, str], float]]:
        found = samples.get(f"{family}{series}", [])
        return [(labels, v) for _, labels, v in found if labels.get("phase") == phase]

    count = sum(v for _, v in one("_count"))
    total = sum(v for _, v in one("_sum"))
    edges = sorted((float(labels["le"]), v) for labels, v in one("_bucket"))
    at_most = next((edge for edge, n in edges if n >= count), math.inf)
    return {"count": count, "mean": total / count if count else 0.0, "at_most": at_most}
