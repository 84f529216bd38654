"""``disagg-bench routing``: run the routing benchmark and write its artefacts.

Writes ``routing.json`` (every run), ``routing.md`` (the table) and merges the three ratios into
``summary.json`` in ``--out-dir``. The real-vLLM parts start vLLM: run them under
``flock /tmp/vllm-e2e.lock``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.results import log_folder, recorded_command, write_json
from bench.routing import PARTS, RoutingBenchSpec, routing_summary, run_routing

DEFAULT_OUT = Path("docs/benchmarks")


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"subset of {PARTS}")
    for f in fields(RoutingBenchSpec):
        if f.name != "parts":
            parser.add_argument(
                f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default
            )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work-dir", type=Path, help="instance and router logs (default: temp)")


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(result: dict[str, Any], command: str) -> str:
    """The routing table: per part, each run's TTFT (ms) and the ratio against its baseline."""
    lines = ["# Routing benchmark", "", f"Command: `{command}`", ""]
    lines += ["| part | run | completed | TTFT ms mean / p50 / p99 | P prefix-cache hit rate |"]
    lines += ["|---|---|---|---|---|"]
    for part in PARTS:
        for name, run in result.get(part, {}).get("runs", {}).items():
            rate = run.get("prefill_prefix_cache_hit_rate")
            lines.append(
                f"| {part} | {name} | {run['completed']}/{run['completed'] + run['failed']} | "
                f"{_fmt(run['mean_ttft_ms'])} / {_fmt(run['p50_ttft_ms'])} / "
                f"{_fmt(run['p99_ttft_ms'])} | {_fmt(rate, 2)} |"
            )
    lines += ["", "| key | value | goal |", "|---|---|---|"]
    goals = {"ttft_prefix_affinity_over_round_robin": "<= 0.6"}
    goals |= {"ttft_conditional_over_aggregated_light": "<= 1.10"}
    goals |= {"p99_ttft_p2c_over_round_robin_uneven": "<= 0.8"}
    goals |= {"ttft_kv_aware_over_round_robin": "<= 0.5"}
    goals |= {"ttft_kv_aware_over_vllm_router_kv_aware": "<= 0.8"}
    goals |= {"p_hit_rate_kv_aware_over_vllm_router_kv_aware": ">= 1.0"}
    goals |= {"router_cpu_kv_aware_over_round_robin": "-"}
    goals |= {"p99_ttft_least_in_flight_workers_over_one": "-"}
    goals |= {"throughput_workers_over_one": "-"}
    for key, value in routing_summary(result).items():
        lines.append(f"| `{key}` | {_fmt(value, 3)} | {goals[key]} |")
    workers = _workers_markdown(result.get("workers", {}).get("throughput"))
    return "\n".join(lines) + "\n" + workers + _kv_markdown(result.get("kv"))


def _workers_markdown(throughput: dict[str, Any] | None) -> str:
    """The workers part's closed loop: per round and router, req/s and router CPU ms/request."""
    if not throughput or not throughput.get("rounds"):
        return ""
    spec = throughput["spec"]
    lines = ["", "## workers: closed-loop throughput, zero-delay fakes", ""]
    lines += [f"{spec['requests']} requests per round at concurrency {spec['concurrency']}:", ""]
    lines += ["| round | router | req/s | router CPU ms/request | failed |"]
    lines += ["|---|---|---|---|---|"]
    for index, row in enumerate(throughput["rounds"], start=1):
        for name, run in row.items():
            lines.append(
                f"| {index} | {name} | {_fmt(run['rps'])} | "
                f"{_fmt(run['router_cpu_ms_per_request'], 2)} | {run['failed']} |"
            )
    ratios = ", ".join(_fmt(r, 2) for r in throughput["per_round_workers_over_one"])
    lines += ["", f"Per round, {spec['workers']} workers / 1: {ratios}."]
    return "\n".join(lines) + "\n"


def _kv_markdown(kv: dict[str, Any] | None) -> str:
    """The kv part's table: per stack, mean over repetitions [min, max]."""
    if not kv:
        return ""
    lines = ["", "## kv: KV-aware routing (mean over repetitions [min, max])", ""]
    lines += ["| stack | TTFT ms mean | TTFT ms p99 | P hit rate | router CPU ms/request |"]
    lines += ["|---|---|---|---|---|"]
    for name, row in kv["stacks"].items():
        cells = []
        for key, digits in (
            ("mean_ttft_ms", 1),
            ("p99_ttft_ms", 1),
            ("p_hit_rate", 2),
            ("router_cpu_ms_per_request", 2),
        ):
            lo_hi = row.get(key + "_spread") or [None, None]
            cells.append(
                f"{_fmt(row.get(key), digits)} [{_fmt(lo_hi[0], digits)}, {_fmt(lo_hi[1], digits)}]"
            )
        errors = [r["error"] for r in row["repetitions"] if "error" in r]
        note = f" (error: {errors[0]})" if errors else ""
        lines.append(f"| {name}{note} | " + " | ".join(cells) + " |")
    lines += ["", "Best achievable P hit rate (one cache holding everything): "]
    lines[-1] += _fmt(kv["p_hit_rate_best"], 2)
    return "\n".join(lines) + "\n"


def merge_parts(previous: Path, fresh: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
    """``fresh`` plus the parts of an earlier ``routing.json`` that this run did not repeat.

    A run of some parts (``--parts kv``) must not erase the committed results of the others; each
    part keeps the command that made it.
    """
    if not previous.exists():
        return fresh
    earlier = json.loads(previous.read_text())
    kept = {p: earlier[p] for p in PARTS if p not in parts and p in earlier}
    for value in kept.values():
        value.setdefault("command", earlier.get("command"))
    return {**fresh, **kept}


def routing_command(args: argparse.Namespace) -> int:
    values = {f.name: getattr(args, f.name) for f in fields(RoutingBenchSpec) if f.name != "parts"}
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}", file=sys.stderr)
        return 2
    spec = RoutingBenchSpec(parts=parts, **values)
    command = recorded_command(sys.argv[1:])
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with log_folder(args.work_dir, "bench-routing-") as work:
        fresh = run_routing(spec, work)
    for part in set(parts) & set(fresh):
        fresh[part]["command"] = command
    result = {"command": command, **merge_parts(out / "routing.json", fresh, parts)}
    write_json(out / "routing.json", result)
    (out / "routing.md").write_text(render_markdown(result, command))
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary.update({k: v for k, v in routing_summary(result).items() if v is not None})
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(render_markdown(result, command))
    return 0
