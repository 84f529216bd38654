"""``disagg-bench fit-profile``: measure real vLLM CPU, fit, write the profile and the report.

Who calls it: :mod:`bench.cli`. The measurement and the fit are :mod:`bench.profile_fit`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.profile_fit import FitSpec, run_fit
from bench.results import recorded_command, run_in_work_dir
from devstack.emulator.profile import PROFILES_DIR


def add_fit_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile-out",
        type=Path,
        default=PROFILES_DIR / "cpu-tiny.json",
        help="the profile file written",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="emulator-fit.json/.md")
    parser.add_argument(
        "--pin-processes",
        action="store_true",
        help="the instance's whole process on one core (as scenarios --pin-processes runs it)",
    )
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def fit_profile_command(args: argparse.Namespace) -> int:
    data = run_in_work_dir(
        lambda folder: run_fit(FitSpec(), folder, pin_processes=args.pin_processes),
        args.work_dir,
        "disagg-fit-",
    )
    if data is None:
        return 1
    today = datetime.date.today().isoformat()
    command = f"flock /tmp/vllm-e2e.lock .venv/bin/{recorded_command(sys.argv[1:])}"
    data["command"] = command
    source = (
        f"Fitted by `{command}` on {today} to one vLLM CPU instance of the devstack tiny model "
        f"(compiled, VLLM_CPU_KVCACHE_SPACE=1 GiB; whole process on one core: "
        f"{args.pin_processes}): docs/benchmarks/emulator-fit.md "
        "lists every measurement beside the fit. Transfer: the connector path of "
        "docs/benchmarks/transfer.json (disagg-bench transfer); a P and a D meeting for the "
        "first time cost nothing extra (handshake_s 0: not measured here)."
    )
    profile = replace(data["profile"], source=source)
    args.profile_out.write_text(profile.to_json())
    data["profile"] = asdict(profile)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "emulator-fit.json").write_text(json.dumps(data, indent=1) + "\n")
    markdown = format_report(data)
    (args.out_dir / "emulator-fit.md").write_text(markdown)
    print(markdown)
    return 0


def format_report(data: dict[str, Any]) -> str:
    step = data["profile"]["step"]
    lines = [
        "# The `cpu-tiny` emulator profile, fitted to vLLM CPU",
        "",
        f"Produced by `{data['command']}`. Prefill rows: time to first token of one request "
        "alone (median); answer rows: the whole one-token JSON answer instead; decode rows: "
        "the instance's mean inter-token latency while b copies of one "
        "cached prompt of c tokens decode together. Fit: non-negative least squares on relative "
        "error.",
        "",
        "Coefficients: "
        + ", ".join(f"`{k}` {v:.3g}" for k, v in step.items())
        + f", `request_overhead_s` {data['profile']['request_overhead_s']:.3g}, "
        f"`answer_overhead_s` {data['profile']['answer_overhead_s']:.3g}; limits read "
        f"from the instance: {json.dumps(data['limits'])}.",
        "",
        "| row | measured ms | fitted ms | error |",
        "| --- | --- | --- | --- |",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['label']} | {1000 * row['seconds']:.2f} | {1000 * row['fitted_s']:.2f} | "
            f"{100 * row['error']:+.0f} % |"
        )
    return "\n".join(lines) + "\n"
