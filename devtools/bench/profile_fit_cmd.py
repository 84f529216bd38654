"""``disagg-bench fit-profile``: fit an emulator profile and write it with its report: to real
vLLM CPU (measured here), or to a GPU estimator's rows (``--rows``, from
:mod:`bench.aiconfigurator_rows`).

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

from bench.profile_fit import FitSpec, fit_estimates, run_fit
from bench.results import recorded_command, run_in_work_dir, write_outputs
from devstack.emulator.profile import PROFILES_DIR


def add_fit_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile-out", type=Path, help="default: profiles/<name>.json")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="emulator-fit*.json/.md")
    parser.add_argument(
        "--pin-processes",
        action="store_true",
        help="the instance's whole process on one core (as scenarios --pin-processes runs it)",
    )
    parser.add_argument("--rows", type=Path, help="fit these estimator rows instead of vLLM CPU")
    parser.add_argument("--name", default="cpu-tiny", help="the profile's name")
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=61.0,
        help="with --rows: KV cache per GPU, the share of each TP rank (H200, Qwen3-32B at TP 1: "
        "0.9 x 141 GB less 65.5 GB of BF16 weights)",
    )
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def fit_profile_command(args: argparse.Namespace) -> int:
    today = datetime.date.today().isoformat()
    if args.rows is not None:
        data = fit_estimates(json.loads(args.rows.read_text()), args.name, args.kv_cache_gb)
        command = f".venv/bin/{recorded_command(sys.argv[1:])}"
        source = _estimate_source(data["estimates"], command, today, args.kv_cache_gb)
        report = f"emulator-fit-{args.name}"
    else:
        found = run_in_work_dir(
            lambda folder: run_fit(FitSpec(), folder, pin_processes=args.pin_processes),
            args.work_dir,
            "disagg-fit-",
        )
        if found is None:
            return 1
        data = found
        command = f"flock /tmp/vllm-e2e.lock .venv/bin/{recorded_command(sys.argv[1:])}"
        source = _cpu_source(command, today, args.pin_processes)
        report = "emulator-fit"
    data["command"] = command
    profile = replace(data["profile"], source=source)
    profile_out = args.profile_out or PROFILES_DIR / f"{args.name}.json"
    profile_out.parent.mkdir(parents=True, exist_ok=True)
    profile_out.write_text(profile.to_json())
    data["profile"] = asdict(profile)
    out = args.out_dir
    write_outputs(data, format_report(data), out / f"{report}.json", out / f"{report}.md")
    return 0


def _cpu_source(command: str, today: str, pinned: bool) -> str:
    return (
        f"Fitted by `{command}` on {today} to one vLLM CPU instance of the devstack tiny model "
        f"(compiled, VLLM_CPU_KVCACHE_SPACE=1 GiB; whole process on one core: {pinned}): "
        "docs/benchmarks/emulator-fit.md lists every measurement beside the fit. Transfer: the "
        "connector path of docs/benchmarks/transfer.json (disagg-bench transfer); a P and a D "
        "meeting for the first time cost nothing extra (handshake_s 0: not measured here)."
    )


def _estimate_source(estimates: dict[str, Any], command: str, today: str, kv_gb: float) -> str:
    return (
        f"Fitted by `{command}` on {today} to {estimates['estimator']}'s step-time estimates "
        f"for {estimates['model']} on {estimates['system']} ({estimates['backend']}, TP "
        f"{estimates['tp']}; rows by devtools/bench/aiconfigurator_rows.py). KV cache {kv_gb:g} "
        f"GB per GPU{_per_rank(int(estimates['tp']))}, block size 128 (P/D recipes), vLLM's "
        "H200 server limits (8192 batched tokens, 1024 sequences). Transfer: 50 GB/s, a GPU's "
        "share of an AWS P5en's 3,200 Gbit/s EFA, and 1 ms per hand-over (assumed). No request "
        "or answer overhead (the estimator models the GPU only)."
    )


def _per_rank(tp: int) -> str:
    """How a TP instance's profile counts its KV: each rank's share, moved in parallel."""
    if tp == 1:
        return ""
    return (
        f" (each of the {tp} ranks holds and sends its share of every token's KV at once, so "
        "blocks, bytes per token and bandwidth are one rank's)"
    )


def _speed(rate: float | None) -> str:
    if rate is None:
        return ""
    return (
        f" The machine's speed at the fit (`work_rate`): {rate:.0f} pieces of work per CPU "
        "second, the mean of just before and just after the rows."
    )


def format_report(data: dict[str, Any]) -> str:
    """The report: how the rows were made, the coefficients, every row beside the fit."""
    profile = data["profile"]
    how = (
        "Rows: the estimator's step time of one prefill alone and of one decode step of b "
        "sequences of context c."
        if "estimates" in data
        else "Prefill rows: time to first token of one request alone (median); answer rows: "
        "the whole one-token JSON answer instead; decode rows: the instance's mean inter-token "
        "latency while b copies of one cached prompt of c tokens decode together."
    )
    lines = [
        f"# The `{profile['name']}` emulator profile",
        "",
        f"Produced by `{data['command']}`. {how} Fit: non-negative least squares on relative "
        "error.",
        "",
        "Coefficients: "
        + ", ".join(f"`{k}` {v:.3g}" for k, v in profile["step"].items())
        + f", `request_overhead_s` {profile['request_overhead_s']:.3g}, "
        f"`answer_overhead_s` {profile['answer_overhead_s']:.3g}; limits: "
        f"{profile['max_num_batched_tokens']} batched tokens, {profile['max_num_seqs']} "
        f"sequences, {profile['num_blocks']} blocks of {profile['block_size']}."
        + _speed(profile.get("work_rate")),
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
