"""``disagg-bench fleet-routing``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.fleet_routing`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.fleet_routing import FleetRoutingSpec, run_fleet_routing
from bench.results import command_with_options, run_in_work_dir, write_outputs
from devstack.emulator.profile import profile_option

COMMAND = ".venv/bin/disagg-bench fleet-routing --out-dir docs/benchmarks"
_OPTIONS = ("size", "replicas", "rate", "chats", "groups", "profile")


def add_fleet_routing_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FleetRoutingSpec()
    parser.add_argument("--size", type=int, default=defaults.size, help="P (and D) in the fleet")
    parser.add_argument("--replicas", type=int, default=defaults.replicas)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="requests/s")
    parser.add_argument("--chats", type=int, default=defaults.chats)
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument(
        "--profile",
        type=profile_option,
        default=defaults.profile,
        help="the emulator's profile (a name or a file); another than the default writes "
        "fleet-routing-<profile>.json/.md",
    )
    parser.add_argument(
        "--no-vllm-router", action="store_true", help="skip the vllm-router kv_aware run"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="the JSON and markdown")
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def fleet_routing_command(args: argparse.Namespace) -> int:
    options = {k: getattr(args, k) for k in _OPTIONS}
    spec = FleetRoutingSpec(**options, vllm_router=not args.no_vllm_router)
    data = run_in_work_dir(
        lambda folder: run_fleet_routing(spec, folder), args.work_dir, "disagg-fleet-routing-"
    )
    if data is None:
        return 1
    stem = output_stem(spec.profile)
    out = args.out_dir
    write_outputs(data, format_report(data), out / f"{stem}.json", out / f"{stem}.md")
    return 0


def output_stem(profile: str) -> str:
    """``fleet-routing`` for the default profile, else ``fleet-routing-<profile's name>``."""
    if profile == FleetRoutingSpec().profile:
        return "fleet-routing"
    return f"fleet-routing-{Path(profile).stem}"


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults."""
    off = {"vllm_router": "--no-vllm-router"}
    return command_with_options(COMMAND, spec, asdict(FleetRoutingSpec()), _OPTIONS, off)


def format_report(data: dict[str, Any]) -> str:
    """fleet-routing.md: the command, the setup, a row per run, the summary keys."""
    spec, runs = data["spec"], data["runs"]
    n, size = spec["replicas"], spec["size"]
    lines = [
        "# KV-aware routing on one emulated fleet: one router, replicas, vllm-router",
        "",
        f"Produced by `{_command(spec)}`. A {size}P{size}D fleet of emulated engines (profile "
        f"`{spec['profile']}`, one process on core 0, a fresh fleet per run: empty prefix "
        "caches), the routers on core 1. Ours: push mode, KV-aware for both pools over every "
        "instance's KV event stream, each replica with its own health checks, load scrapes and "
        "in-flight counts. vllm-router: vLLM's P/D mode (pull), `--prefill-policy kv_aware` "
        f"over every P's KV events, decode round robin. Workload: {data['requests']} requests "
        f"at {spec['rate']:g}/s (Poisson, the same arrivals in every run): {spec['chats']} "
        f"chats of {spec['turns']} turns ({spec['chat_system_len']}-token system prompt each, "
        f"{spec['turn_len']} tokens per turn) and {spec['groups']} shared system prompts of "
        f"{spec['group_prefix_len']} tokens asked {spec['group_size']} questions each; "
        f"{spec['output_len']} output tokens. Best achievable P hit rate (one cache holding "
        f"everything): {data['best_hit_rate']:.3f}.",
        "",
        "- `one`: our router, every request to it;",
        f"- `spread`: {n} replicas of ours, request i to replica i mod {n};",
        f"- `agreement`: the same {n} replicas, every request to all of them at once under one "
        "`X-Request-Id`; each replica's JSON request log names the P it chose (hit rate and "
        f"TTFT not reported: each prompt was sent {n} times);",
        "- `vllm_router`: vllm-router kv_aware over the same fleet in pull mode.",
        "",
        "| run | routers | sent | failed | P hit rate | mean TTFT ms | all replicas chose the "
        "same P |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        agreed = "agreement" in run
        same = f"{run['agreement']:.3f} of {run['compared']}" if agreed else "-"
        hit = "-" if agreed else f"{run['p_hit_rate']:.3f}"
        ttft = "-" if agreed else f"{run['mean_ttft_ms']:.1f}"
        lines.append(
            f"| {name} | {run['routers']} | {run['sent']} | {run['failed']} | {hit} | {ttft} "
            f"| {same} |"
        )
    lines += _stages_lines(runs.get("one", {}).get("router_ttft_stages_ms", {}))
    lines += ["", "Summary:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"


def _stages_lines(stages: dict[str, float]) -> list[str]:
    """The `one` run's router TTFT stages (stage -> mean ms) as a sentence, in the order the
    router exported them; none when the run recorded none."""
    if not stages:
        return []
    parts = [f"{stage} {ms:.2f} ms" for stage, ms in stages.items()]
    return [
        "",
        "Where `one`'s TTFT goes inside the router (means of its `disagg_router_ttft_stage_seconds`"
        f" over the run): {', '.join(parts)}; they add up to {sum(stages.values()):.2f} ms.",
    ]
