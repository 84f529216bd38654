"""Closed-loop throughput of ``serve --workers N`` against one worker, same fakes, same run.

Who calls it: :mod:`bench.routing` (the ``workers`` part of ``disagg-bench routing``). It starts
a zero-delay fake prefill and a fake decode instance as processes (:func:`bench.overhead.
fake_process`), two routers over them (one worker and ``workers`` workers, unpinned: the
workers need the machine's cores), and offers each the same closed loop (``concurrency``
streams, ``requests`` requests) in alternating rounds, so a machine that gets busier or quieter
during the run moves both alike. Each round records the achieved request rate and the router's
CPU time per request (the supervisor and every worker: each worker leads a process group of its
own, so the CPU is summed over the router's process tree). The ratio is
:func:`throughput_summary`'s: the mean rate at ``workers`` workers over the mean at one.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.overhead import FAKE_PREFILL_IDENTITY, MODEL, PREFILL_ENGINE_ID, fake_process
from bench.routers import our_router, router_config
from devstack.ports import free_ports
from devstack.process import tree_cpu_seconds


@dataclass(frozen=True)
class ThroughputSpec:
    """The closed loop each router gets, per round."""

    workers: int = 2
    rounds: int = 3
    requests: int = 1000
    concurrency: int = 32
    input_len: int = 128
    output_len: int = 16
    seed: int = 0


def label(workers: int) -> str:
    """The key of a worker count's rows (``workers_1``, ``workers_2``)."""
    return f"workers_{workers}"


def throughput_summary(
    rounds: Sequence[Mapping[str, Mapping[str, Any]]], workers: int
) -> dict[str, Any]:
    """Means over ``rounds`` (each ``{label: {"rps", "router_cpu_ms_per_request", "failed"}}``)
    and ``throughput_workers_over_one`` = mean rps at ``workers`` / mean rps at one worker,
    with each round's own ratio; the ratio is ``None`` when a round has failures or a rate is 0."""
    one, many = label(1), label(workers)
    out: dict[str, Any] = {"rounds": [dict(r) for r in rounds]}
    ok = bool(rounds) and all(r[k]["failed"] == 0 for r in rounds for k in (one, many))
    for key in (one, many):
        rates = [float(r[key]["rps"]) for r in rounds]
        cpus = [float(r[key]["router_cpu_ms_per_request"]) for r in rounds]
        out[f"{key}_rps"] = sum(rates) / len(rates) if rates else None
        out[f"{key}_router_cpu_ms_per_request"] = sum(cpus) / len(cpus) if cpus else None
    base = out[f"{one}_rps"]
    per_round = [r[many]["rps"] / r[one]["rps"] if r[one]["rps"] else None for r in rounds]
    out["per_round_workers_over_one"] = per_round
    out["throughput_workers_over_one"] = out[f"{many}_rps"] / base if ok and base else None
    return out


async def _closed_loop(
    targets: Mapping[str, tuple[Target, int]], spec: ThroughputSpec
) -> list[dict[str, dict[str, Any]]]:
    """Every round, every router in turn: the closed loop, its rate and router CPU."""
    load = LoadSpec(max_concurrency=spec.concurrency, show_progress=False, time_limit_s=300.0)
    shape = SyntheticSpec(spec.requests, spec.input_len, spec.output_len, seed=spec.seed)
    requests = make_token_prompts(shape)
    warm = make_token_prompts(SyntheticSpec(2 * spec.concurrency, spec.input_len, 4, seed=99))
    rounds: list[dict[str, dict[str, Any]]] = []
    async with make_client() as client:
        for target, _ in targets.values():
            await run_load(client, target, warm, load)
        for index in range(spec.rounds):
            row: dict[str, dict[str, Any]] = {}
            for name, (target, pid) in targets.items():
                print(f"workers: round {index + 1}, {name}", file=sys.stderr)
                before = tree_cpu_seconds(pid)
                m = (await run_load(client, target, requests, load)).metrics
                used = tree_cpu_seconds(pid) - before
                row[name] = {
                    "rps": m.request_throughput,
                    "completed": m.completed,
                    "failed": m.failed,
                    "router_cpu_ms_per_request": 1000 * used / max(m.completed, 1),
                }
            rounds.append(row)
    return rounds


def run_workers_throughput(spec: ThroughputSpec, logs: Path) -> dict[str, Any]:
    """Start the fakes and both routers, run the rounds, stop everything; returns
    :func:`throughput_summary` plus the spec."""
    p_port, d_port, one_port, many_port = free_ports(4)
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    config = router_config(MODEL, p_url, d_url, identity=FAKE_PREFILL_IDENTITY)
    targets: dict[str, tuple[Target, int]] = {}
    with ExitStack() as stack:
        stack.enter_context(fake_process("fake-prefill", p_port, logs, PREFILL_ENGINE_ID))
        stack.enter_context(fake_process("fake-decode", d_port, logs))
        for workers, port in ((1, one_port), (spec.workers, many_port)):
            router = stack.enter_context(our_router(config, port, logs, workers=workers))
            target = Target(f"http://127.0.0.1:{port}", MODEL)
            targets[label(workers)] = (target, router.pid or 0)
        rounds = asyncio.run(_closed_loop(targets, spec))
    return {"spec": spec.__dict__, **throughput_summary(rounds, spec.workers)}
