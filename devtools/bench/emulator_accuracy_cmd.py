"""``disagg-bench emulator-accuracy``: the scenario flags, both sweeps, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run and the comparison are :mod:`bench.emulator_accuracy`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.emulator_accuracy import run_accuracy
from bench.results import recorded_command, run_in_work_dir, write_outputs
from bench.scenarios_cmd import add_scenarios_arguments, sweep_spec

ACCURACY_STACKS = "ours,aggregated"


def add_emulator_accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenarios_arguments(parser)
    parser.set_defaults(stacks=ACCURACY_STACKS, repetitions=1, fractions="0.3,0.9")


def emulator_accuracy_command(args: argparse.Namespace) -> int:
    stacks = tuple(s for s in args.stacks.split(",") if s)
    try:
        spec = sweep_spec(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = args.out_dir / "emulator-accuracy"
    data = run_in_work_dir(
        lambda work: run_accuracy(spec, stacks, runs, work), args.work_dir, "bench-accuracy-"
    )
    if data is None:
        return 1
    data["command"] = recorded_command(sys.argv[1:])
    out = args.out_dir
    write_outputs(
        data, format_report(data), out / "emulator-accuracy.json", out / "emulator-accuracy.md"
    )
    return 0 if not any(data["errors"].values()) else 1


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def format_report(data: dict[str, Any]) -> str:
    """emulator-accuracy.md: the command, per point real vs emulated, the ratios, the keys."""
    lines = [
        "# The emulator against real vLLM CPU",
        "",
        f"Produced by `{data['command']}`: the scenario sweep on real vLLM CPU instances (tiny "
        "model, P on core 0, D on core 1), then on emulated twins (profile `cpu-tiny`, one "
        "process), the same routers, prompts, arrivals and offered loads (fractions of the real "
        "stack's capacity in both runs).",
        "",
        "| stack | input | x capacity | TTFT ms real / emulated (error) "
        "| TPOT ms real / emulated (error) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in data["points"]:
        lines.append(
            f"| {p['stack']} | {p['input_len']} | {p['fraction']:g} | "
            f"{p['real_mean_ttft_ms']:.1f} / {p['emulated_mean_ttft_ms']:.1f} "
            f"({_pct(p['error_mean_ttft_ms'])}) | {p['real_mean_tpot_ms']:.2f} / "
            f"{p['emulated_mean_tpot_ms']:.2f} ({_pct(p['error_mean_tpot_ms'])}) |"
        )
    lines += ["", "| ratio | real | emulated | error |", "| --- | --- | --- | --- |"]
    for r in data["ratios"]:
        lines.append(
            f"| {r['ratio']} | {r['real']:.3f} | {r['emulated']:.3f} | {_pct(r['error'])} |"
        )
    lines += [
        "",
        "| stack | input | capacity req/s real / emulated (error) |",
        "| --- | --- | --- |",
    ]
    for c in data["capacities"]:
        lines.append(
            f"| {c['stack']} | {c['input_len']} | {c['real_rps']:.2f} / "
            f"{c['emulated_rps']:.2f} ({_pct(c['error'])}) |"
        )
    lines += ["", "Summary:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"
