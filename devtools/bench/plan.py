"""The cheapest xPyD fleet that meets a latency SLO for a workload, found on emulated engines.

Who calls it: ``disagg-bench plan`` (:mod:`bench.plan_cmd`). Fleets are tried by instance count,
smallest first; at each count every split into P and D, in each transfer mode asked for. A shape
whose offered load is above what the profile says its P or its D can do is not run (its queue only
grows: :func:`screen`). Every other one runs on a fresh emulated fleet (one process on the first
core) behind a fresh router of ours (the last core), P and D by fewest legs in flight
(:func:`bench.emulated_stack.fewest_in_flight_config`), with ``requests`` Poisson arrivals of the
workload; the first ``ramp`` of them fill the fleet and are not measured. A shape meets the SLO when
no request failed and the percentile asked for of both TTFT and TPOT is within the bound. The search
stops after the first count where a shape met it; of those, the choice has the lowest TTFT at that
percentile.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.emulated_stack import FleetSetup, fewest_in_flight_config, fleet_behind_router
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import RequestRecord, percentile
from bench.routers import leg_timeouts
from devstack.emulator.profile import Profile, load_profile

MODES = ("push", "pull")


def parse_pairs(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """``"a=1,b=2"`` as numbers; ``ValueError`` naming a key not in ``names``, a missing one or
    a value that is not a positive number."""
    found: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(f"{item!r}: expected one of {', '.join(names)} as name=value")
        try:
            found[key] = float(value)
        except ValueError:
            raise ValueError(f"{key}: {value!r} is not a number") from None
        if not found[key] > 0:
            raise ValueError(f"{key}: must be positive, got {value}")
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (expected {', '.join(names)})")
    return found


@dataclass(frozen=True)
class Workload:
    """Every request: ``isl`` prompt tokens, ``osl`` output tokens; ``rate`` requests per
    second, Poisson."""

    isl: int
    osl: int
    rate: float

    @classmethod
    def parse(cls, text: str) -> Workload:
        """From ``isl=4096,osl=512,rate=4``."""
        v = parse_pairs(text, ("isl", "osl", "rate"))
        return cls(int(v["isl"]), int(v["osl"]), v["rate"])


@dataclass(frozen=True)
class Slo:
    """Bounds on the ``percentile``-th TTFT and TPOT, in milliseconds."""

    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0

    @classmethod
    def parse(cls, text: str) -> Slo:
        """From ``ttft=1000,tpot=30`` (and optionally ``,percentile=99``)."""
        names = ("ttft", "tpot", "percentile") if "percentile" in text else ("ttft", "tpot")
        v = parse_pairs(text, names)
        if v.get("percentile", 0.0) > 100:
            raise ValueError(f"percentile: at most 100, got {v['percentile']:g}")
        return cls(v["ttft"], v["tpot"], v.get("percentile", 90.0))


@dataclass(frozen=True)
class PlanSpec:
    """What to plan for and how far to search."""

    profile: str
    workload: Workload
    slo: Slo
    max_instances: int = 8
    gpus_per_instance: int = 1
    modes: tuple[str, ...] = ("push",)
    requests: int = 200
    ramp: float = 0.2
    """The share of the requests, the first ones, that fill the fleet and are not measured."""
    seed: int = 0
    ready_timeout_s: float = 120.0
    aiconfigurator_system: str = "h200_sxm"
    """aiconfigurator's name of the GPU the profile describes, for its recommendation."""


@dataclass(frozen=True)
class Shape:
    prefill: int
    decode: int
    mode: str

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D {self.mode}"


def shapes(spec: PlanSpec) -> Iterator[list[Shape]]:
    """Per instance count, smallest first: every P/D split in every mode of ``spec``."""
    for total in range(2, spec.max_instances + 1):
        yield [Shape(p, total - p, m) for p in range(1, total) for m in spec.modes]


def screen(shape: Shape, workload: Workload, profile: Profile) -> dict[str, float]:
    """What the profile says of ``shape`` under ``workload``, before running it:
    ``p_load``, the offered prefill work over P's capacity (one prompt at a time per P, which
    chunked prefill of one long prompt is); ``d_load``, the offered decode tokens over what the
    Ds emit at most, every D's cache full of sequences at half their output; ``ttft_floor_ms``,
    one request alone (its prefill, its KV's transfer, D's first step); ``tpot_floor_ms``, one
    sequence's decode step alone."""
    context = workload.isl + workload.osl // 2
    per_sequence = math.ceil((workload.isl + workload.osl) / profile.block_size)
    fits = max(1, min(profile.max_num_seqs, (profile.num_blocks - 1) // per_sequence))
    d_tokens_per_s = fits / profile.decode_step_seconds(fits, context)
    return {
        "p_load": workload.rate * profile.prefill_seconds(workload.isl) / shape.prefill,
        "d_load": workload.rate * workload.osl / (shape.decode * d_tokens_per_s),
        "ttft_floor_ms": 1000
        * (
            profile.prefill_seconds(workload.isl)
            + profile.transfer.seconds(workload.isl, first_meeting=False)
            + profile.decode_step_seconds(1, workload.isl)
        ),
        "tpot_floor_ms": 1000 * profile.decode_step_seconds(1, context),
    }


def run_plan(spec: PlanSpec, work: Path) -> dict[str, Any]:
    """The search; every shape tried with its figures, and the choice (None: none met)."""
    profile = load_profile(spec.profile)
    prompts = make_token_prompts(
        SyntheticSpec(spec.requests, spec.workload.isl, spec.workload.osl, seed=spec.seed)
    )
    rows: list[dict[str, Any]] = []
    for candidates in shapes(spec):
        for shape in candidates:
            rows.append(_try(shape, spec, profile, prompts, work))
            print(_line(rows[-1]), flush=True)
        if any(r["met"] for r in rows):
            break
    met = [r for r in rows if r["met"]]
    choice = min(met, key=lambda r: r["ttft_ms"]) if met else None
    return {"spec": asdict(spec), "profile_source": profile.source, "rows": rows, "choice": choice}


def aiconfigurator_answer(spec: PlanSpec, python: Path) -> dict[str, Any]:
    """aiconfigurator's recommendation for the same model, GPU, workload and SLO
    (:mod:`bench.aiconfigurator_plan`, run by ``python``, an environment with aiconfigurator);
    ``subprocess.CalledProcessError`` when it fails."""
    w, slo = spec.workload, spec.slo
    script = Path(__file__).with_name("aiconfigurator_plan.py")
    argv = [str(python), str(script), "--model", load_profile(spec.profile).model]
    argv += ["--system", spec.aiconfigurator_system, "--tp", str(spec.gpus_per_instance)]
    argv += ["--isl", str(w.isl), "--osl", str(w.osl), "--rate", f"{w.rate:g}"]
    argv += ["--ttft", f"{slo.ttft_ms:g}", "--tpot", f"{slo.tpot_ms:g}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _try(
    shape: Shape, spec: PlanSpec, profile: Profile, prompts: list[Any], work: Path
) -> dict[str, Any]:
    estimate = screen(shape, spec.workload, profile)
    row: dict[str, Any] = {
        **asdict(shape),
        "gpus": (shape.prefill + shape.decode) * spec.gpus_per_instance,
        **estimate,
    }
    if estimate["ttft_floor_ms"] > spec.slo.ttft_ms:
        return {**row, "ran": False, "met": False, "why": "one request alone is over the TTFT"}
    if estimate["tpot_floor_ms"] > spec.slo.tpot_ms:
        return {**row, "ran": False, "met": False, "why": "one sequence's step is over the TPOT"}
    if max(estimate["p_load"], estimate["d_load"]) >= 1.0:
        return {**row, "ran": False, "met": False, "why": "offered load over capacity"}
    figures = run_shape(shape, spec, profile, prompts, work / shape.name.replace(" ", "-"))
    return {**row, **figures, "ran": True, "met": meets(figures, spec.slo), "why": ""}


def meets(figures: Mapping[str, Any], slo: Slo) -> bool:
    """No failure, and the SLO's percentile of TTFT and TPOT within its bounds."""
    failed: int = figures["failed"]
    ttft: float = figures["ttft_ms"]
    tpot: float = figures["tpot_ms"]
    return failed == 0 and ttft <= slo.ttft_ms and tpot <= slo.tpot_ms


def run_shape(
    shape: Shape, spec: PlanSpec, profile: Profile, prompts: list[Any], logs: Path
) -> dict[str, Any]:
    """One shape on a fresh emulated fleet and router; its measured figures."""
    setup = FleetSetup(shape.prefill, shape.decode, spec.profile, transfer_mode=shape.mode)
    config = partial(
        fewest_in_flight_config, model=profile.model, mode=shape.mode, timeouts=leg_timeouts(300.0)
    )
    with fleet_behind_router(setup, config, logs, spec.ready_timeout_s) as fleet:
        target = Target(fleet.router_url, profile.model)
        records = asyncio.run(_load(target, prompts, spec))
    return figures(records[math.floor(spec.ramp * len(records)) :], spec.slo.percentile)


async def _load(target: Target, prompts: list[Any], spec: PlanSpec) -> list[RequestRecord]:
    load = LoadSpec(request_rate=spec.workload.rate, seed=spec.seed, show_progress=False)
    async with make_client() as client:
        result = await run_load(client, target, prompts, load)
    return list(result.records)


def figures(records: list[RequestRecord], pct: float) -> dict[str, Any]:
    """The measured requests' TTFT and TPOT at ``pct`` and their medians, in ms."""
    ok = [r for r in records if r.success]
    ttft = [1000 * r.ttft for r in ok]
    tpot = [1000 * t for r in ok if (t := r.tpot()) is not None]
    return {
        "measured": len(records),
        "failed": len(records) - len(ok),
        "ttft_ms": percentile(ttft, pct),
        "tpot_ms": percentile(tpot, pct),
        "ttft_p50_ms": percentile(ttft, 50),
        "tpot_p50_ms": percentile(tpot, 50),
    }


def _line(row: Mapping[str, Any]) -> str:
    head = f"{row['prefill']}P{row['decode']}D {row['mode']}"
    if not row["ran"]:
        return f"{head}: not run ({row['why']}; P load {row['p_load']:.2f}, D {row['d_load']:.2f})"
    return (
        f"{head}: TTFT {row['ttft_ms']:.0f} ms TPOT {row['tpot_ms']:.1f} ms failed "
        f"{row['failed']} {'meets' if row['met'] else 'misses'} the SLO"
    )
