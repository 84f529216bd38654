"""``disagg-bench answers``: flags, run, JSON + markdown output (see :mod:`bench.answers_run`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.answers_run import AnswersSpec, run_answers
from bench.results import write_outputs
from devstack.process import ProcessStartError


def add_answers_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1300, help="prompts, each sent once")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kill-p", action="store_true", help="do not kill and restart P")
    parser.add_argument("--log-dir", type=Path, help="child process logs (default: a temp dir)")
    parser.add_argument("--result-file", type=Path, help="write JSON results here")
    parser.add_argument("--markdown-file", type=Path, help="write the markdown table here")


def format_report(data: dict[str, Any]) -> str:
    """One markdown table of a run."""
    push, faults, spec = data["push"], data["faults"], data["spec"]
    failed = ", ".join(f"{n} x {why}" for why, n in push["failed_by_reason"].items()) or "none"
    kv = ", ".join(f"{name} {usage:g}" for name, usage in data["kv_cache_usage_after"].items())
    killed = f"{faults['p_killed_after']} done / {faults['p_restart_s']} s"
    rows = [
        ("requests (each prompt once), concurrency", f"{spec['requests']}, {spec['concurrency']}"),
        ("completed answers compared", str(data["compared"])),
        ("differ from the aggregated instance's", str(data["mismatched"])),
        (
            "reference runs that disagree (compared where both agree)",
            str(data["reference_unstable"]),
        ),
        ("left by the client at a random moment", str(faults["random_aborts"])),
        ("streams left after their first token", str(faults["first_token_aborts"])),
        ("P killed (SIGKILL) after / restarted in", killed),
        ("failed (allowed)", f"{push['failed']}: {failed}"),
        ("KV cache usage after", kv),
    ]
    lines = ["| what | figure |", "| --- | --- |"]
    return "\n".join(lines + [f"| {what} | {figure} |" for what, figure in rows])


def answers_command(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        print("error: --requests, --concurrency and --max-tokens must be > 0", file=sys.stderr)
        return 2
    spec = AnswersSpec(
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        seed=args.seed,
        kill_p=not args.no_kill_p,
    )
    try:
        data = run_answers(spec, args.log_dir)
    except ProcessStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_outputs(data, format_report(data), args.result_file, args.markdown_file)
    clean = all(usage == 0 for usage in data["kv_cache_usage_after"].values())
    return 0 if data["mismatched"] == 0 and clean else 3
