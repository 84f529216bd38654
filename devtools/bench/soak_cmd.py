"""``disagg-bench soak``: flags, run, JSON + markdown output."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results import write_outputs
from bench.soak import SoakSpec, format_report, run_soak
from devstack.process import ProcessStartError


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("fakes", "vllm"), default="fakes")
    parser.add_argument("--concurrency", type=int, default=50, help="concurrent streams")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--sample-interval", type=float, default=10.0, help="RSS/fd sampling, s")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--log-dir", type=Path, help="child process logs (default: a temp dir)")
    parser.add_argument("--result-file", type=Path, help="write JSON results here")
    parser.add_argument("--markdown-file", type=Path, help="append the markdown row here")


def soak_command(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.duration <= 0 or args.sample_interval <= 0:
        print("error: --concurrency, --duration and --sample-interval must be > 0", file=sys.stderr)
        return 2
    spec = SoakSpec(
        backend=args.backend,
        concurrency=args.concurrency,
        duration_s=args.duration,
        sample_s=args.sample_interval,
        input_len=args.input_len,
        output_len=args.output_len,
    )
    try:
        data = run_soak(spec, args.log_dir)
    except ProcessStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_outputs(data, format_report(data), args.result_file, args.markdown_file, append=True)
    counts = data["counts"]
    return 0 if counts["lost"] == 0 and counts["garbled"] == 0 else 3
