"""``disagg-bench fleet-failover``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.fleet_failover`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from bench.fleet_failover import FleetFailoverSpec, run_fleet_failover
from bench.fleet_options import add_fleet_arguments
from bench.results import command_with_options, run_in_work_dir, write_outputs

COMMAND = ".venv/bin/disagg-bench fleet-failover --out-dir docs/benchmarks"
_OPTIONS = ("size", "profile", "requests", "loaded_fraction", "kills", "output_len")


def add_fleet_failover_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FleetFailoverSpec()
    add_fleet_arguments(parser, defaults, "fleet-failover.json/.md")
    parser.add_argument("--kills", type=int, default=defaults.kills, help="Ds killed, in turn")
    parser.add_argument("--output-len", type=int, default=defaults.output_len)


def fleet_failover_command(args: argparse.Namespace) -> int:
    spec = FleetFailoverSpec(**{k: getattr(args, k) for k in _OPTIONS})
    data = run_in_work_dir(
        lambda folder: run_fleet_failover(spec, folder), args.work_dir, "disagg-fleet-failover-"
    )
    if data is None:
        return 1
    out = args.out_dir
    write_outputs(data, format_report(data), out / "fleet-failover.json", out / "fleet-failover.md")
    return 0


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults."""
    return command_with_options(COMMAND, spec, asdict(FleetFailoverSpec()), _OPTIONS)


def format_report(data: dict[str, Any]) -> str:
    """fleet-failover.md: the command, the setup, the streams, the kills, the summary keys."""
    spec, size = data["spec"], data["spec"]["size"]
    resume = data["resume_s"]
    kills = ", ".join(
        f"{k['name']} at {k['at_s']:.1f} s ({k['in_flight']} in flight)" for k in data["kills"]
    )
    computed = "; ".join(
        f"{phase}: {c['count']:g} attempts, mean {c['mean']:.0f}, at most {c['at_most']:g}"
        for phase, c in data["p_computed_tokens"].items()
    )
    lines = [
        "# D failover on an emulated fleet",
        "",
        f"Produced by `{_command(spec)}`. A {size}P{size}D fleet of emulated engines (profile "
        f"`{spec['profile']}`, one process on core 0), our router on core 1: push, stream "
        "migration on (its default), P and D by fewest legs in flight, health checked every "
        f"second. {spec['requests']} Poisson streams of new {spec['input_len']}-token prompts, "
        f"{spec['output_len']} output tokens each, at {data['rate']:.2f} requests/s "
        f"({spec['loaded_fraction']:g} of the fleet's prefill capacity); {spec['kills']} Ds "
        "killed in turn at even intervals over the arrivals (the engine drops its connections "
        "as a dead process's would; the router is not told).",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| streams whole ([DONE], {spec['output_len']} tokens, no error) "
        f"| {data['whole']} / {data['streams']} |",
        f"| kills | {kills} |",
        f"| streams whose dispatch was on a killed D | {data['on_killed']} "
        f"({data['on_killed_whole']} whole) |",
        f"| their longest gap between tokens (time to resume) | p50 {resume['p50'] * 1000:.0f} "
        f"ms, max {resume['max'] * 1000:.0f} ms ({resume['count']:g} streams) |",
        f"| the run's TTFT (a full retry's wait) | p50 {data['ttft_p50_s'] * 1000:.0f} ms |",
        f"| migrations (router) | {_labels(data['migrations'])} |",
        f"| D failovers by phase (router) | {_labels(data['failovers'])} |",
        f"| prompt tokens P computed per attempt after a D failure | {computed or '-'} |",
        "",
        "summary.json keys:",
        "",
    ]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    if data["not_whole"]:
        lines += ["", "Streams not whole (first 20):", ""]
        lines += [f"- `{f['id']}`: {f['tokens']} tokens, {f['error']}" for f in data["not_whole"]]
    return "\n".join(lines) + "\n"


def _labels(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) or "none"
