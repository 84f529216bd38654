"""``disagg-bench fleet-binding``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.fleet_binding`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from bench.fleet_binding import FleetBindingSpec, run_fleet_binding
from bench.fleet_options import add_fleet_arguments
from bench.results import command_with_options, run_in_work_dir, write_outputs

COMMAND = ".venv/bin/disagg-bench fleet-binding --out-dir docs/benchmarks"
_OPTIONS = ("size", "profile", "requests", "loaded_fraction", "d_prompts")


def add_fleet_binding_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FleetBindingSpec()
    add_fleet_arguments(parser, defaults, "fleet-binding.json/.md")
    parser.add_argument(
        "--d-prompts", type=int, default=defaults.d_prompts, help="D's KV in long requests"
    )


def fleet_binding_command(args: argparse.Namespace) -> int:
    spec = FleetBindingSpec(**{k: getattr(args, k) for k in _OPTIONS})
    data = run_in_work_dir(
        lambda folder: run_fleet_binding(spec, folder), args.work_dir, "disagg-fleet-binding-"
    )
    if data is None:
        return 1
    out = args.out_dir
    write_outputs(data, format_report(data), out / "fleet-binding.json", out / "fleet-binding.md")
    return 0


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults."""
    return command_with_options(COMMAND, spec, asdict(FleetBindingSpec()), _OPTIONS)


def format_report(data: dict[str, Any]) -> str:
    """fleet-binding.md: the command, the setup, a row per mode, the summary keys."""
    spec, size = data["spec"], data["spec"]["size"]
    lines = [
        "# Binding D late on an emulated fleet",
        "",
        f"Produced by `{_command(spec)}`. A {size}P{size}D fleet of emulated engines (profile "
        f"`{spec['profile']}`, one process on core 0, a fresh fleet per mode), our router on "
        "core 1: push mode, P and D by fewest legs in flight, prompts of "
        f"{spec['short_len']} tokens to D alone. Each D's KV cache is cut to "
        f"{data['d_blocks']} blocks ({spec['d_prompts']} long requests). Prompts of "
        f"{spec['input_len']} token ids through P ({data['prefill_s'] * 1000:.0f} ms of "
        f"prefill each, from the profile), {100 * spec['short_share']:g} % short ones spread "
        f"among them, {spec['output_len']} output tokens; P's speed learned from "
        f"{spec['waves']} waves of one long request per P, then {spec['requests']} Poisson "
        f"arrivals at {data['rate']:.2f} requests/s ({spec['loaded_fraction']:g} of the fleet's "
        "prefill capacity), the same in every mode. D unwritten block-s: our connector's "
        "counter on every D (the emulator keeps it as the connector does); P's wait for D's "
        "registration over every P. Times are the emulated engines' (no instance slows "
        "another); the router runs on a real core.",
        "",
        "| bind | completed | failed | TTFT mean ms | TTFT p99 ms | D alone: TTFT p99 ms "
        "| D unwritten block-s | P wait for D p50 ms | P waited for D % | binds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bind, m in data["modes"].items():
        wait, binds = m["p_wait"], ", ".join(f"{k} {v:g}" for k, v in sorted(m["binds"].items()))
        lines.append(
            f"| {bind} | {m['completed']} | {m['failed']} | {m['ttft_mean_ms']:.1f} "
            f"| {m['ttft_p99_ms']:.1f} | {m['alone_ttft_p99_ms']:.1f} "
            f"| {m['unwritten_block_s']:.1f} | {wait['p50_ms']:.2f} "
            f"| {100 * wait['nonzero']:.1f} | {binds} |"
        )
    lines += ["", "summary.json keys:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"
