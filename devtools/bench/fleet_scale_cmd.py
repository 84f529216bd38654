"""``disagg-bench fleet-scale``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.fleet_scale`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.fleet_scale import FleetScaleSpec, run_fleet_scale
from bench.results import command_with_options, run_in_work_dir, write_outputs

COMMAND = ".venv/bin/disagg-bench fleet-scale --out-dir docs/benchmarks"


def add_fleet_scale_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FleetScaleSpec()
    parser.add_argument(
        "--sizes", default=",".join(map(str, defaults.sizes)), help="P (and D) per fleet"
    )
    parser.add_argument("--rate", type=float, default=defaults.rate, help="requests/s")
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="fleet-scale.json/.md")
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def fleet_scale_command(args: argparse.Namespace) -> int:
    spec = FleetScaleSpec(
        sizes=tuple(int(s) for s in args.sizes.split(",")),
        rate=args.rate,
        requests=args.requests,
    )
    data = run_in_work_dir(
        lambda folder: run_fleet_scale(spec, folder), args.work_dir, "disagg-fleet-scale-"
    )
    if data is None:
        return 1
    out = args.out_dir
    write_outputs(data, format_report(data), out / "fleet-scale.json", out / "fleet-scale.md")
    return 0


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults (``--sizes`` as
    its flag takes them)."""

    def sizes(value: Any) -> str:
        return ",".join(map(str, value))

    named = dict(spec) | {"sizes": sizes(spec["sizes"])}
    defaults = asdict(FleetScaleSpec()) | {"sizes": sizes(FleetScaleSpec().sizes)}
    return command_with_options(COMMAND, named, defaults, ("sizes", "rate", "requests"))


def format_report(data: dict[str, Any]) -> str:
    """fleet-scale.md: the command, the setup, a row per size, the summary key."""
    spec = data["spec"]
    lines = [
        "# Router cost against fleet size (emulated fleets)",
        "",
        f"Produced by `{_command(spec)}`. Fleets of emulated engines (profile `{spec['profile']}`, "
        "one process on core 0), our router in push mode on core 1 alone, KV-aware routing of "
        "both pools over every instance's KV event stream, health checks and load scrapes at "
        f"their defaults. Poisson load of {spec['rate']:g} requests/s, {spec['requests']} "
        f"streamed requests per run after {spec['warmups']} warm-ups, token-id prompts of "
        f"{spec['input_len']} tokens sharing {spec['prefix_len']}, {spec['output_len']} output "
        "tokens. Each size ran twice, in mirrored order; CPU per request pools both runs.",
        "",
        "| P and D each | completed | failed | router CPU ms/request (runs) | router RSS MiB "
        "| KV index blocks | mean TTFT ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, cell in data["sizes"].items():
        runs = ", ".join(f"{v:.2f}" for v in cell["router_cpu_ms_per_request_runs"])
        lines.append(
            f"| {size} | {cell['completed']} | {cell['failed']} | "
            f"{cell['router_cpu_ms_per_request']:.2f} ({runs}) | {cell['router_rss_mib']:.0f} | "
            f"{cell['indexed_blocks']} | {cell['mean_ttft_ms']:.1f} |"
        )
    lines += ["", "Summary:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"
