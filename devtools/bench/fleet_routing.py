"""KV-aware routing on one emulated fleet: our router alone, as replicas, and ``vllm-router``'s
``kv_aware``: P's prefix-cache hit rate, TTFT, and whether replicas choose the same P.

Who calls it: ``disagg-bench fleet-routing`` (:mod:`bench.fleet_routing_cmd`). Each run starts a
fresh emulated fleet (``python -m devstack.emulator``, one process on the first core: its prefix
caches start empty) and its routers on the last core. Our router is KV-aware for both pools over
every instance's KV event stream, in push mode; each replica has its own health checks, scrapes
and in-flight counts (docs/discovery.md, "Several router replicas"). ``vllm-router`` runs in
vLLM's P/D mode (pull, the only one it has) with ``--prefill-policy kv_aware`` over every P's KV
events. The workload is :func:`bench.routing_kv.kv_requests`'s: multi-turn chats, each with its
own system prompt, and groups of requests sharing a long system prompt, at Poisson arrivals, the
same for every run. The runs:

- ``one``: our router, every request to it;
- ``spread``: ``replicas`` of our router, request ``i`` to replica ``i mod replicas``, as a load
  balancer spreads them;
- ``agreement``: the same replicas, every request to every replica at once under one
  ``X-Request-Id``; each replica's JSON request log names the P it chose, and the share of
  requests for which all chose the same P is ``replica_choice_agreement`` (offering each request
  ``replicas`` times is what lets every replica route the same request; the run's hit rate and
  TTFT are not reported);
- ``vllm_router``: ``vllm-router`` kv_aware (decode round robin) over a pull-mode fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.arrivals import arrival_offsets
from bench.breakdown import router_stages, scrape
from bench.client import Target, send_request
from bench.dataset import BenchRequest
from bench.emulated_stack import emulator_process, fleet_instances
from bench.fleet_scale import kv_aware_config, kv_streams_live, wait_for
from bench.loadgen import launch_paced, make_client
from bench.metrics import RequestRecord, rounded_ratio
from bench.overhead import cpu_split
from bench.routers import our_router, vllm_router
from bench.routing_kv import (
    KvWorkload,
    best_hit_rate,
    hit_rate,
    kv_requests,
    p_cache_counters,
)
from devstack.emulator.profile import Profile, load_profile
from devstack.ports import free_ports
from devstack.process import ChildProcess, start_all, stop_all
from devstack.tiny_model import make_tiny_model

OURS = ("one", "spread", "agreement")
VLLM_ROUTER = "vllm_router"
RUNS = (*OURS, VLLM_ROUTER)


@dataclass(frozen=True)
class FleetRoutingSpec:
    """The fleet, the replicas and the workload (:class:`bench.routing_kv.KvWorkload`'s
    fields: ``chats`` chats of ``turns`` turns, ``groups`` shared system prompts asked
    ``group_size`` questions each)."""

    size: int = 16
    replicas: int = 3
    rate: float = 10.0
    chats: int = 60
    turns: int = 3
    chat_system_len: int = 512
    turn_len: int = 64
    groups: int = 200
    group_size: int = 3
    group_prefix_len: int = 1024
    question_len: int = 32
    output_len: int = 8
    seed: int = 0
    profile: str = "cpu-tiny"
    ready_timeout_s: float = 180.0
    vllm_router: bool = True

    def workload(self) -> KvWorkload:
        return KvWorkload(
            chats=self.chats,
            turns=self.turns,
            chat_system_len=self.chat_system_len,
            turn_len=self.turn_len,
            groups=self.groups,
            group_size=self.group_size,
            group_prefix_len=self.group_prefix_len,
            question_len=self.question_len,
            output_len=self.output_len,
            seed=self.seed,
        )


def router_config(instances: dict[str, Any], model: str, tokenizer: Path) -> dict[str, Any]:
    """Our router's config: fleet-scale's (KV-aware for both pools) with a JSON summary line
    per request."""
    return {**kv_aware_config(instances, model, tokenizer), "logging": {"format": "json"}}


def vllm_router_args(instances: dict[str, Any], block_size: int) -> list[str]:
    """``vllm-router``'s policies: kv_aware over every P's KV events, decode round robin."""
    args = ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin"]
    for p in instances["prefill"]:
        args += ["--pd-kv-events", f"{p['url']}={p['kv_events_endpoint']}"]
    return [*args, "--kv-event-block-size", str(block_size)]


def chosen_prefills(lines: Iterable[str]) -> dict[str, str]:
    """Client request id -> the P a replica chose, from its log's JSON request summaries
    (other lines, and summaries without a client id or a P, are skipped)."""
    found: dict[str, str] = {}
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        client_id, prefill = record.get("client_request_id"), record.get("prefill")
        if isinstance(client_id, str) and isinstance(prefill, str):
            found[client_id] = prefill
    return found


def agreement(choices: Sequence[dict[str, str]]) -> tuple[float, int]:
    """The share of the requests every replica routed for which all chose the same P, and
    how many such requests there were."""
    if not choices:
        return 0.0, 0
    common = set(choices[0]).intersection(*choices[1:])
    same = sum(1 for key in common if len({c[key] for c in choices}) == 1)
    return (same / len(common) if common else 0.0), len(common)


def send_plan(
    run: str, requests: Sequence[BenchRequest], targets: Sequence[Target]
) -> list[list[tuple[Target, BenchRequest]]]:
    """Per arrival, what goes where: to the next target in turn (``spread``), to every
    target under one request id (``agreement``), else to the first target."""
    if run == "spread":
        return [[(targets[i % len(targets)], r)] for i, r in enumerate(requests)]
    if run != "agreement":
        return [[(targets[0], r)] for r in requests]
    plan = []
    for i, request in enumerate(requests):
        tagged = [dataclasses.replace(t, headers=(("X-Request-Id", f"rq-{i}"),)) for t in targets]
        plan.append([(t, request) for t in tagged])
    return plan


async def _offer(
    plan: Sequence[Sequence[tuple[Target, BenchRequest]]],
    rate: float,
    seed: int,
    metrics_url: str | None,
) -> tuple[list[RequestRecord], dict[str, float]]:
    """Each arrival's sends at its Poisson offset; every record once all have ended, and the
    mean milliseconds of each router TTFT stage over them, by stage (scraped from the router's
    ``metrics_url`` before and after; empty when None)."""
    offsets = arrival_offsets(len(plan), rate, seed=seed)
    metrics = {"router": metrics_url} if metrics_url is not None else {}
    async with make_client() as client:
        before = await scrape(client, metrics)

        async def arrival(i: int) -> list[RequestRecord]:
            return await asyncio.gather(*(send_request(client, t, r) for t, r in plan[i]))

        tasks = await launch_paced(arrival, offsets, time.perf_counter())
        records = [record for sends in await asyncio.gather(*tasks) for record in sends]
        stages = router_stages(before, await scrape(client, metrics))
    return records, stages


def run_once(
    run: str, spec: FleetRoutingSpec, requests: list[BenchRequest], work: Path
) -> dict[str, Any]:
    """One run on a fresh fleet and fresh routers: hit rate, TTFT, failures, choices."""
    fleet_cpus, router_cpus = cpu_split(pin=True)
    count = spec.replicas if run in ("spread", "agreement") else 1
    control, *ports = free_ports(1 + count)
    logs = work / run
    logs.mkdir(parents=True, exist_ok=True)
    profile = load_profile(spec.profile)
    model = profile.model
    with ExitStack() as stack:
        fleet = emulator_process(
            prefill=spec.size,
            decode=spec.size,
            control_port=control,
            log=logs / "fleet.log",
            profile=spec.profile,
            cpus=fleet_cpus,
            transfer_mode="pull" if run == VLLM_ROUTER else "push",
        )
        stack.enter_context(fleet)
        instances = fleet_instances(control)
        routers = _routers(run, spec, profile, instances, ports, work, logs, router_cpus)
        stack.callback(stop_all, routers)
        start_all(routers, spec.ready_timeout_s)
        for port in ports if run != VLLM_ROUTER else ():
            url = f"http://127.0.0.1:{port}"
            live = partial(kv_streams_live, url, model, 2 * spec.size)
            wait_for(live, spec.ready_timeout_s, f"the KV streams of the router on {port}")
        targets = [Target(f"http://127.0.0.1:{port}", model) for port in ports]
        p_urls = [entry["url"] for entry in instances["prefill"]]
        before = p_cache_counters(p_urls)
        metrics_url = f"{targets[0].base_url}/metrics" if run == "one" else None
        plan = send_plan(run, requests, targets)
        records, stages = asyncio.run(_offer(plan, spec.rate, spec.seed, metrics_url))
        p_hit_rate = hit_rate(before, p_cache_counters(p_urls))
    ok = [r for r in records if r.success]
    result: dict[str, Any] = {
        "run": run,
        "routers": count,
        "sent": len(records),
        "failed": len(records) - len(ok),
        "errors": [r.error for r in records if not r.success][:5],
        "p_hit_rate": p_hit_rate,
        "mean_ttft_ms": 1000 * statistics.fmean(r.ttft for r in ok) if ok else 0.0,
    }
    if stages:
        result["router_ttft_stages_ms"] = stages
    if run == "agreement":
        choices = [chosen_prefills(r.log_path.read_text().splitlines()) for r in routers]
        result["agreement"], result["compared"] = agreement(choices)
    return result


def _routers(
    run: str,
    spec: FleetRoutingSpec,
    profile: Profile,
    instances: dict[str, Any],
    ports: Sequence[int],
    work: Path,
    logs: Path,
    cpus: str | None,
) -> list[ChildProcess]:
    """The run's routers, unstarted: ``vllm-router`` on the first port, or ours on each."""
    timeout = spec.ready_timeout_s
    if run == VLLM_ROUTER:
        prefills, decodes = ([i["url"] for i in instances[r]] for r in ("prefill", "decode"))
        extra = vllm_router_args(instances, profile.block_size)
        return [vllm_router(prefills, decodes, ports[0], logs, timeout, cpus, extra)]
    config = router_config(instances, profile.model, make_tiny_model(work / "tiny"))
    return [our_router(config, port, logs, timeout, cpus, log_level="info") for port in ports]


def run_fleet_routing(spec: FleetRoutingSpec, work: Path) -> dict[str, Any]:
    """Every run on the same requests and arrivals; the summary keys."""
    requests = kv_requests(spec.workload())
    runs = {}
    for run in RUNS if spec.vllm_router else OURS:
        runs[run] = run_once(run, spec, requests, work)
        print(f"{run}: {runs[run]}", flush=True)
    return {
        "spec": asdict(spec),
        "requests": len(requests),
        "best_hit_rate": best_hit_rate(requests, load_profile(spec.profile).block_size),
        "runs": runs,
        "summary": summary_keys(spec, runs),
    }


def summary_keys(spec: FleetRoutingSpec, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures for docs/benchmarks/summary.json (the ``vllm_router`` ones when it ran)."""
    one, n, fleet = runs["one"], spec.replicas, f"{spec.size}p{spec.size}d"
    keys: dict[str, Any] = {
        "replica_choice_agreement": round(runs["agreement"]["agreement"], 3),
        f"p_hit_rate_{n}_replicas_over_1": rounded_ratio(
            runs["spread"]["p_hit_rate"], one["p_hit_rate"]
        ),
    }
    theirs = runs.get(VLLM_ROUTER)
    if theirs is not None:
        keys[f"p_hit_rate_{fleet}_over_vllm_router_kv_aware"] = rounded_ratio(
            one["p_hit_rate"], theirs["p_hit_rate"]
        )
        keys[f"ttft_{fleet}_over_vllm_router_kv_aware"] = rounded_ratio(
            one["mean_ttft_ms"], theirs["mean_ttft_ms"]
        )
    return keys
