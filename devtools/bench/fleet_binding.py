"""Binding D late (``push.bind``) at fleet scale on emulated engines, where P's prefill takes
what its profile says: eager, just_in_time and adaptive over one xPyD shape.

Who calls it: ``disagg-bench fleet-binding`` (:mod:`bench.fleet_binding_cmd`). Each mode runs on
a fresh emulated fleet (``python -m devstack.emulator`` on the first core: empty caches, zeroed
counters) with D's KV cache cut to ``d_prompts`` long requests, and a fresh router on the last
core (push, P and D by fewest legs in flight: over two Ds, ``disagg-bench bind``'s
``power_of_two`` is the same choice; prompts below ``disaggregation.min_prompt_tokens`` to D
alone, as that benchmark runs them on real vLLM).
P's speed is learned first from waves of one long request per P; then ``requests`` Poisson
arrivals (the same for every mode) at ``loaded_fraction`` of the fleet's prefill capacity, which
the profile gives (:meth:`Profile.prefill_seconds`). Per mode, from the instances' and the router's
``/metrics`` before and after: D's unwritten block-seconds (our connector's
``disagg_push_unwritten_block_seconds_total``, which the emulator keeps as the connector does),
P's wait for D's registration (``disagg_push_wait_for_registration_seconds``, every P pooled),
how the router bound D; from the client: TTFT of the pushed requests and of those D served
alone. Unlike vLLM CPU on this machine's two shared cores, no instance here slows another, so
the binding's prediction of P's finish meets the P the profile describes.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.binding import BINDS, prompt_mix
from bench.client import Target
from bench.dataset import BenchRequest
from bench.emulated_stack import FleetSetup, fewest_in_flight_config, fleet_behind_router
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import RequestRecord, percentile, rounded_ratio
from bench.routers import leg_timeouts
from bench.scrapes import Scrape, by_label, delta, histogram, pooled, scrape
from devstack.emulator.profile import Profile, load_profile

D_POOL, P_POOL = "decodes", "prefills"
"""The names the scrapes pool every D and every P under."""


@dataclass(frozen=True)
class FleetBindingSpec:
    """The fleet (``size`` P and as many D of ``profile``), the prompts and the load."""

    size: int = 16
    profile: str = "h200-qwen3-32b-tp1"
    input_len: int = 8192
    short_len: int = 256
    short_share: float = 0.5
    """The share of the requests with short prompts, which D serves alone."""
    output_len: int = 64
    d_prompts: int = 2
    """D's KV cache holds this many long requests (prompt and output)."""
    loaded_fraction: float = 0.8
    requests: int = 480
    waves: int = 3
    """Warm-up waves of one long request per P (the binding predicts a P's finish after 3)."""
    seed: int = 0
    ready_timeout_s: float = 180.0

    @property
    def min_prompt_tokens(self) -> int:
        """The router's ``disaggregation.min_prompt_tokens``: halfway between the lengths."""
        return (self.input_len + self.short_len) // 2

    def prompts(self) -> tuple[list[BenchRequest], list[BenchRequest]]:
        """The warm-up waves' long prompts and the measured ones (:func:`prompt_mix`): the
        same for every mode."""
        lengths = (self.input_len, self.short_len)
        warmups = self.waves * self.size
        return prompt_mix(
            self.requests, warmups, lengths, self.short_share, self.output_len, self.seed
        )

    def d_blocks(self, profile: Profile) -> int:
        """Each D's KV cache in blocks: ``d_prompts`` long requests and vLLM's null block."""
        per_request = math.ceil((self.input_len + self.output_len) / profile.block_size)
        return self.d_prompts * per_request + 1


def offered_rate(spec: FleetBindingSpec, profile: Profile) -> float:
    """Requests per second, short ones included, that keep every P ``loaded_fraction`` busy."""
    long_rate = spec.loaded_fraction * spec.size / profile.prefill_seconds(spec.input_len)
    return long_rate / (1.0 - spec.short_share)


def run_fleet_binding(spec: FleetBindingSpec, work: Path) -> dict[str, Any]:
    """Every mode on its own fleet, the same prompts and arrivals; the summary keys."""
    profile = load_profile(spec.profile)
    prompts = spec.prompts()
    rate = offered_rate(spec, profile)
    modes = {}
    for bind in BINDS:
        modes[bind] = run_mode(bind, spec, prompts, rate, work)
        print(f"{bind}: {_line(modes[bind])}", flush=True)
    return {
        "spec": asdict(spec),
        "prefill_s": profile.prefill_seconds(spec.input_len),
        "rate": rate,
        "d_blocks": spec.d_blocks(profile),
        "modes": modes,
        "summary": summary_keys(spec, modes),
    }


def run_mode(
    bind: str,
    spec: FleetBindingSpec,
    prompts: tuple[list[BenchRequest], list[BenchRequest]],
    rate: float,
    work: Path,
) -> dict[str, Any]:
    """One mode on a fresh fleet and router: warm-up waves, then the measured load."""
    profile = load_profile(spec.profile)
    setup = FleetSetup(spec.size, spec.size, spec.profile, decode_num_blocks=spec.d_blocks(profile))
    config = partial(router_config, model=profile.model, bind=bind, spec=spec)
    timeout = spec.ready_timeout_s
    with fleet_behind_router(setup, config, work / bind, timeout, log_level="info") as fleet:
        return asyncio.run(
            _measure(fleet.router_url, fleet.instances, profile.model, prompts, rate, spec)
        )


def router_config(
    instances: dict[str, Any], model: str, bind: str, spec: FleetBindingSpec
) -> dict[str, Any]:
    """Our router over the fleet: push with ``push.bind`` = ``bind``; P and D by fewest legs
    in flight (a late binding chooses D with the loads of its moment; ``power_of_two`` would
    compare two of the Ds only, and may bind onto a D whose cache is full while another's
    has room); short prompts to D alone; loads scraped every 0.5 s."""
    return fewest_in_flight_config(
        instances,
        model,
        push={"bind": bind},
        load_signals={"interval": 0.5, "stale_after": 2.0},
        disaggregation={"min_prompt_tokens": spec.min_prompt_tokens},
        timeouts=leg_timeouts(300.0),
    )


async def _measure(
    url: str,
    instances: dict[str, Any],
    model: str,
    prompts: tuple[list[BenchRequest], list[BenchRequest]],
    rate: float,
    spec: FleetBindingSpec,
) -> dict[str, Any]:
    warm, measured = prompts
    target = Target(url, model)
    names = {e["name"]: e["url"] for role in ("prefill", "decode") for e in instances[role]}
    urls = {"router": url, **names}
    async with make_client() as client:
        for wave in range(spec.waves):  # one long request per P at once: each learns its speed
            batch = warm[wave * spec.size : (wave + 1) * spec.size]
            await run_load(client, target, batch, LoadSpec(show_progress=False))
        before = await scrape(client, urls)
        load = LoadSpec(request_rate=rate, seed=spec.seed, show_progress=False)
        result = await run_load(client, target, measured, load)
        after = await scrape(client, urls)
    records = list(result.records)
    return _figures(records, spec, _pools(before, instances), _pools(after, instances))


def _pools(snapshot: Scrape, instances: dict[str, Any]) -> Scrape:
    ps = [e["name"] for e in instances["prefill"]]
    ds = [e["name"] for e in instances["decode"]]
    return pooled(pooled(snapshot, ps, P_POOL), ds, D_POOL)


def _figures(
    records: list[RequestRecord], spec: FleetBindingSpec, before: Scrape, after: Scrape
) -> dict[str, Any]:
    """A mode's figures: the client's TTFTs of the requests through P and of those D served
    alone (below ``min_prompt_tokens``, as the router splits them) and the scrapes'
    differences."""
    ok = [r for r in records if r.success]
    pushed = [1000 * r.ttft for r in ok if r.prompt_len >= spec.min_prompt_tokens]
    alone = [1000 * r.ttft for r in ok if r.prompt_len < spec.min_prompt_tokens]
    wait = "disagg_push_wait_for_registration_seconds"
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "ttft_mean_ms": statistics.fmean(pushed) if pushed else 0.0,
        "ttft_p99_ms": percentile(pushed, 99),
        "alone_ttft_p99_ms": percentile(alone, 99),
        "unwritten_block_s": delta(
            before, after, D_POOL, "disagg_push_unwritten_block_seconds_total"
        ),
        "p_wait": histogram(before, after, P_POOL, wait),
        "binds": by_label(before, after, "router", "disagg_router_decode_binds_total", "reason"),
    }


def summary_keys(spec: FleetBindingSpec, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures for docs/benchmarks/summary.json."""
    fleet = f"{spec.size}p{spec.size}d"
    eager, jit, adaptive = (modes[b] for b in BINDS)
    better = min(eager["ttft_mean_ms"], jit["ttft_mean_ms"])
    return {
        f"d_idle_block_seconds_jit_over_eager_{fleet}_emulated": rounded_ratio(
            jit["unwritten_block_s"], eager["unwritten_block_s"]
        ),
        f"p_wait_for_d_p50_ms_{fleet}_emulated": round(jit["p_wait"]["p50_ms"], 3),
        f"ttft_jit_over_eager_{fleet}_emulated": rounded_ratio(
            jit["ttft_mean_ms"], eager["ttft_mean_ms"]
        ),
        f"ttft_adaptive_over_better_{fleet}_emulated": rounded_ratio(
            adaptive["ttft_mean_ms"], better
        ),
    }


def _line(mode: dict[str, Any]) -> str:
    wait = mode["p_wait"]
    return (
        f"done {mode['completed']} failed {mode['failed']} ttft mean {mode['ttft_mean_ms']:.0f} "
        f"ms unwritten {mode['unwritten_block_s']:.1f} block-s P wait p50 "
        f"{wait['p50_ms']:.1f} ms waited {100 * wait['nonzero']:.0f} % binds {mode['binds']}"
    )
