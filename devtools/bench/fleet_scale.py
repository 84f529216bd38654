"""Router cost against fleet size, on emulated fleets: CPU per request and memory of our router
over 1P1D, 4P4D, 16P16D and 32P32D at one request rate.

Who calls it: ``disagg-bench fleet-scale`` (:mod:`bench.fleet_scale_cmd`). For each size it
starts an emulated fleet (``python -m devstack.emulator``, one process, on the first core) and
our router in push mode over it (on the last core, alone) with everything a large fleet makes
it do: KV-aware routing of both pools with every instance's KV event stream indexed, health
checks and load-signal scrapes at their defaults. Then it offers the same Poisson streamed load
(token-id prompts sharing a prefix) and records the router's CPU time per completed request,
its memory, and the blocks its KV index holds. Sizes run in a mirrored order (1, 4, 16, 32, 32,
16, 4, 1) so that a drift of the machine's speed hits small and large fleets alike; each size's
figure pools both of its runs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.emulated_stack import FleetSetup, fleet_behind_router
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import rounded_ratio
from bench.results import metrics_to_dict
from devstack.emulator.profile import load_profile
from devstack.process import group_cpu_seconds
from devstack.tiny_model import make_tiny_model


@dataclass(frozen=True)
class FleetScaleSpec:
    """The load and the sizes (``sizes``: P and D instances each)."""

    sizes: tuple[int, ...] = (1, 4, 16, 32)
    rate: float = 20.0
    requests: int = 400
    warmups: int = 40
    input_len: int = 512
    prefix_len: int = 256
    output_len: int = 16
    profile: str = "cpu-tiny"
    ready_timeout_s: float = 180.0


def kv_aware_config(instances: dict[str, Any], model: str, tokenizer: Path) -> dict[str, Any]:
    """Our router over an emulated fleet's ``instances``: push mode, KV-aware for both pools
    over every instance's KV event stream."""
    return {
        "models": [model],
        "mode": "push",
        "prefill": {"policy": "kv_aware", "instances": instances["prefill"]},
        "decode": {"policy": "kv_aware", "instances": instances["decode"]},
        "kv_events": {"enabled": True, "tokenizer": str(tokenizer)},
    }


def kv_streams_live(url: str, model: str, count: int) -> bool:
    """Whether the router at ``url`` has its tokenizer and ``count`` live KV event streams."""
    state = httpx.get(f"{url}/ready", timeout=10).json().get("kv_events", {}).get(model, {})
    streams = state.get("instances", {})
    live = [s for s in streams.values() if s.get("state") == "live"]
    return state.get("tokenizer") == "loaded" and len(live) == count


def _indexed_blocks(url: str, model: str) -> int:
    state = httpx.get(f"{url}/ready", timeout=10).json()["kv_events"][model]
    return sum(int(s.get("blocks", 0)) for s in state["instances"].values())


def wait_for(check: Any, timeout_s: float, what: str) -> None:
    """Poll ``check()`` every 0.5 s until true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20


def run_point(size: int, spec: FleetScaleSpec, work: Path) -> dict[str, Any]:
    """One size: start the fleet and the router, load them, stop them; the point's figures."""
    model = load_profile(spec.profile).model
    tokenizer = make_tiny_model(work / "tiny")
    setup = FleetSetup(size, size, spec.profile, kv_events=True)
    config = partial(kv_aware_config, model=model, tokenizer=tokenizer)
    with fleet_behind_router(
        setup, config, work / f"{size}p{size}d", spec.ready_timeout_s
    ) as fleet:
        url, router = fleet.router_url, fleet.router
        live = partial(kv_streams_live, url, model, 2 * size)
        wait_for(live, spec.ready_timeout_s, "KV streams")
        assert router.pid is not None  # started: its pid leads its process group
        result = asyncio.run(_load(url, model, spec, router.pid))
        stats = httpx.get(f"{fleet.control_url}/stats", timeout=10).json()
        return {
            "size": size,
            **result,
            "router_rss_mib": _rss_mib(router.pid),
            "indexed_blocks": _indexed_blocks(url, model),
            "fleet_transfers": stats["transfers"],
            "fleet_engine_failures": stats["engine_failures"],
        }


async def _load(url: str, model: str, spec: FleetScaleSpec, pgid: int) -> dict[str, Any]:
    requests = make_token_prompts(
        SyntheticSpec(
            num_requests=spec.requests + spec.warmups,
            input_len=spec.input_len,
            output_len=spec.output_len,
            prefix_len=spec.prefix_len,
        )
    )
    target = Target(url, model)
    async with make_client() as client:
        warm = LoadSpec(request_rate=spec.rate, show_progress=False, seed=1)
        await run_load(client, target, requests[: spec.warmups], warm)
        before = group_cpu_seconds(pgid)
        load = LoadSpec(request_rate=spec.rate, show_progress=False, seed=2)
        result = await run_load(client, target, requests[spec.warmups :], load)
        used = group_cpu_seconds(pgid) - before
    metrics = metrics_to_dict(result.metrics)
    done = max(1, int(metrics["completed"]))
    return {
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "router_cpu_s": used,
        "router_cpu_ms_per_request": 1000 * used / done,
        "router_cpu_us_per_token": 1e6 * used / max(1, int(metrics["total_output_tokens"])),
        "mean_ttft_ms": metrics["mean_ttft_ms"],
        "mean_tpot_ms": metrics["mean_tpot_ms"],
    }


def run_fleet_scale(spec: FleetScaleSpec, work: Path) -> dict[str, Any]:
    """Every size twice in mirrored order; per size the pooled figures; the summary ratio."""
    order = list(spec.sizes) + list(reversed(spec.sizes))
    runs = []
    for size in order:
        point = run_point(size, spec, work)
        print(f"fleet {size}P{size}D: {point}", flush=True)
        runs.append(point)
    sizes = {size: pooled_runs([r for r in runs if r["size"] == size]) for size in spec.sizes}
    smallest, largest = sizes[min(spec.sizes)], sizes[max(spec.sizes)]
    ratio = rounded_ratio(
        largest["router_cpu_ms_per_request"], smallest["router_cpu_ms_per_request"]
    )
    return {
        "spec": asdict(spec),
        "runs": runs,
        "sizes": {str(k): v for k, v in sizes.items()},
        "summary": {
            f"router_cpu_per_request_{max(spec.sizes)}p{max(spec.sizes)}d_over_1p1d": ratio
        },
    }


def pooled_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One size's figure from its runs: CPU per request over both, the larger memory."""
    cpu = sum(r["router_cpu_s"] for r in runs)
    done = sum(r["completed"] for r in runs)
    return {
        "completed": done,
        "failed": sum(r["failed"] for r in runs),
        "router_cpu_ms_per_request": 1000 * cpu / max(1, done),
        "router_cpu_ms_per_request_runs": [r["router_cpu_ms_per_request"] for r in runs],
        "router_rss_mib": max(r["router_rss_mib"] for r in runs),
        "indexed_blocks": max(r["indexed_blocks"] for r in runs),
        "mean_ttft_ms": sum(r["mean_ttft_ms"] for r in runs) / len(runs),
    }
