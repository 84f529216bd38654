"""``disagg-bench overhead``: flags, run, JSON + markdown output."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.overhead import OverheadSpec, format_report, run_overhead
from bench.results import write_outputs
from devstack.process import ProcessStartError

ROUTERS = ("ours", "floor", "vllm-router")


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="100,250,500", help="comma-separated req/s")
    parser.add_argument("--seconds-per-rate", type=float, default=6.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--saturation-concurrency", type=int, default=32)
    parser.add_argument("--saturation-requests", type=int, default=1000)
    parser.add_argument(
        "--saturation-rounds",
        type=int,
        default=1,
        help="closed loops per target, the targets taking turns (CPU per request pooled)",
    )
    routers = ",".join(ROUTERS)
    parser.add_argument("--routers", default=routers, help=f"subset of {routers}")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="another checkout of the repository (older ones hold router/ at the root), run "
        "beside ours as the target 'baseline' on the same fakes: two commits compared in one run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        help="seconds the fakes wait between streamed tokens (default 0: back to back)",
    )
    parser.add_argument(
        "--marginal-output-len",
        type=int,
        help="a second output length: each fixed rate also runs at it, and the report gives the "
        "CPU each relayed token adds (the slope between the two lengths)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the fakes to the first CPU and the routers to the last",
    )
    parser.add_argument("--log-dir", type=Path, help="child process logs (default: a temp dir)")
    parser.add_argument("--result-file", type=Path, help="write JSON results here")
    parser.add_argument("--markdown-file", type=Path, help="write the markdown tables here")


def overhead_command(args: argparse.Namespace) -> int:
    routers = tuple(r for r in args.routers.split(",") if r)
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        print(f"error: --routers: unknown {unknown}, choose from {ROUTERS}", file=sys.stderr)
        return 2
    try:
        spec = _spec(args, routers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        load_before = os.getloadavg()
        data = run_overhead(spec, args.log_dir)
        data["loadavg_before_after"] = [load_before, os.getloadavg()]
    except ProcessStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_outputs(data, format_report(data["derived"]), args.result_file, args.markdown_file)
    return 0


def _spec(args: argparse.Namespace, routers: tuple[str, ...]) -> OverheadSpec:
    """The run the flags describe (``ValueError`` naming a bad one)."""
    return OverheadSpec(
        rates=tuple(float(r) for r in args.rates.split(",")),
        seconds_per_rate=args.seconds_per_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        saturation_concurrency=args.saturation_concurrency,
        saturation_requests=args.saturation_requests,
        saturation_rounds=args.saturation_rounds,
        baseline=args.baseline,
        routers=routers,
        seed=args.seed,
        pin=not args.no_pin,
        token_delay=args.token_delay,
        marginal_output_len=args.marginal_output_len,
    )
