"""``disagg-bench tenants``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.tenants`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.results import command_with_options, run_in_work_dir
from bench.tenants import TenantsSpec, run_tenants_benchmark

COMMAND = "flock /tmp/vllm-e2e.lock .venv/bin/disagg-bench tenants --out-dir docs/benchmarks"


def add_tenants_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TenantsSpec()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--repetitions", type=int, default=defaults.repetitions)
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight)
    parser.add_argument("--token-run-s", type=float, default=defaults.token_run_s)
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="tenants.json/.md")
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def tenants_command(args: argparse.Namespace) -> int:
    spec = TenantsSpec(
        requests=args.requests,
        repetitions=args.repetitions,
        max_in_flight=args.max_in_flight,
        token_run_s=args.token_run_s,
    )
    data = run_in_work_dir(
        lambda folder: run_tenants_benchmark(spec, folder), args.work_dir, "disagg-tenants-"
    )
    if data is None:
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "tenants.json").write_text(json.dumps(data, indent=1) + "\n")
    markdown = format_report(data)
    (args.out_dir / "tenants.md").write_text(markdown)
    print(markdown)
    return 0


_OPTIONS = ("requests", "repetitions", "max_in_flight", "token_run_s")
"""The :class:`TenantsSpec` fields :func:`add_tenants_arguments` offers as ``--`` options."""


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults."""
    return command_with_options(COMMAND, spec, asdict(TenantsSpec()), _OPTIONS)


def format_report(data: dict[str, Any]) -> str:
    """tenants.md: the command, the setup, one row per (point, tenant), the summary keys."""
    spec, limits, tokens = data["spec"], data["limits"], data["tokens"]
    lines = [
        "# Tenants on real vLLM CPU: a noisy neighbour, priority, a token limit",
        "",
        f"Produced by `{_command(spec)}`: 1P1D, tiny model, our connector; P on core 0, D on "
        f"core 1; prompts of {spec['input_len']} token ids, {spec['output_len']} output tokens; "
        f"the router admits {spec['max_in_flight']} legs per instance, "
        f"{spec['reserved_for_high']} of them for the high class alone (the queue forms in the "
        "router). Capacity "
        f"{data['capacity_rps']:.2f} requests/s (8 clients, no tenants). "
        f"victim and noisy: requests_per_minute {limits['requests_per_minute']} each "
        f"({spec['share']:g} of capacity); the victim offers {spec['victim_fraction']:g} of "
        f"it, the neighbour (tenant noisy) its share, then {spec['noisy_factor']:g}x it; "
        "high (priority high) offers the "
        f"victim's rate, alone (light) and beside bulk (priority low, no limits, "
        f"{spec['saturation']:g}x capacity: saturated). Poisson arrivals, {spec['requests']} "
        f"foreground requests per point, {spec['repetitions']} repetitions (p99: mean, "
        "low-high). Served: answers completed while the foreground's arrivals ran; 429s and "
        "TTFT: of the requests sent then (bulk's wait behind its own backlog).",
        "",
        "| point | tenant | offered req/s | served req/s | 429s | TTFT p50 ms "
        "| TTFT p99 ms (low-high) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, cell in data["table"].items():
        point, tenant = key.split("/")
        lines.append(
            f"| {point} | {tenant} | {cell['rate_rps']:.2f} | {cell['admitted_rps']:.2f} | "
            f"{cell['refused']} | {cell['ttft_p50_ms']:.0f} | {cell['ttft_p99_ms']:.0f} "
            f"({cell['ttft_p99_low_ms']:.0f}-{cell['ttft_p99_high_ms']:.0f}) |"
        )
    lines += [
        "",
        f"Token limit: a greedy tenant (one request at a time, waiting Retry-After after a "
        f"429) for {spec['token_run_s']:g} s under tokens_per_minute {tokens['limit_per_minute']}: "
        f"its answers report {tokens['last_minute']} tokens for the requests it sent in the "
        f"last minute ({tokens['refusals']} refusals).",
        "",
        "summary.json keys:",
        "",
    ]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"
