"""``disagg-bench churn``: flags, run, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.churn`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.churn import ChurnSpec, run_churn
from bench.results import recorded_command, run_in_work_dir, write_outputs


def add_churn_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ChurnSpec()
    parser.add_argument("--size", type=int, default=defaults.size, help="P and D at the start")
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="requests/s")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="churn.json/.md")
    parser.add_argument("--work-dir", type=Path, help="logs (default: a temp dir)")


def churn_command(args: argparse.Namespace) -> int:
    spec = ChurnSpec(size=args.size, seconds=args.seconds, rate=args.rate)
    data = run_in_work_dir(lambda folder: run_churn(spec, folder), args.work_dir, "disagg-churn-")
    if data is None:
        return 1
    data["command"] = f".venv/bin/{recorded_command(sys.argv[1:])}"
    out = args.out_dir
    write_outputs(data, format_report(data), out / "churn.json", out / "churn.md")
    return 0


def format_report(data: dict[str, Any]) -> str:
    spec = data["spec"]
    lines = [
        "# Instances joining and leaving under load (emulated fleet)",
        "",
        f"Produced by `{data['command']}`: {spec['size']}P{spec['size']}D emulated (profile "
        f"`{spec['profile']}`), our router in push mode (least_in_flight, health checks every "
        f"second), {spec['rate']:g} streamed requests/s of {spec['prompt_tokens']} prompt and "
        f"{spec['output_tokens']} output tokens for {spec['seconds']:g} s; every second an "
        "instance is killed (its connections dropped) or one joins, alternately, and the router "
        "reloads its file (SIGHUP).",
        "",
        f"- requests: {data['requests']}, completed: {data['completed']}",
        f"- kills: {data['kills']} (requests in flight on them: "
        f"{data['requests_in_flight_at_kills']}), joins: {data['joins']}",
        f"- failed with their last attempt on a killed instance: "
        f"{data['failed_on_killed_instances']}",
        f"- `churn_failed_requests` (failed otherwise): {data['summary']['churn_failed_requests']}",
    ]
    for o in data["unexplained"]:
        lines.append(f"  - {o['request_id']}: {o['error']}")
    return "\n".join(lines) + "\n"
