"""``disagg-bench transfer``: connector WRITE path vs bare NIXL WRITE."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.results import write_json
from bench.transfer import ALL_KINDS, TP_KINDS, AnyKind, run_transfer
from bench.transfer_spec import TransferSpec


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TransferSpec()
    parser.add_argument("--regions", type=int, default=defaults.regions)
    parser.add_argument("--blocks-per-region", type=int, default=defaults.blocks_per_region)
    parser.add_argument("--block-bytes", type=int, default=defaults.block_bytes)
    parser.add_argument("--blocks-per-write", type=int, default=defaults.blocks_per_write)
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument("--warmups", type=int, default=defaults.warmups)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument(
        "--writer-poll-s", type=float, help="connector-path: P's writer cadence (default: ours)"
    )
    parser.add_argument(
        "--receiver-poll-s", type=float, help="connector-path: D's receiver cadence (default: ours)"
    )
    parser.add_argument(
        "--post-on-finish",
        action="store_true",
        help="connector-path: the thread finishing the prefill posts the WRITE (post_on_finish)",
    )
    parser.add_argument(
        "--p-tp",
        type=int,
        default=defaults.p_tp,
        help="P's tensor-parallel size: that many initiator ranks WRITE their share of every "
        f"block into one D (TP 1); above 1 only the kinds {TP_KINDS} run",
    )
    parser.add_argument(
        "--kinds", help=f"subset of {ALL_KINDS} (default: all; {TP_KINDS} with --p-tp > 1)"
    )
    parser.add_argument("--result-file", type=Path)


def transfer_command(args: argparse.Namespace) -> int:
    spec = TransferSpec(
        regions=args.regions,
        blocks_per_region=args.blocks_per_region,
        block_bytes=args.block_bytes,
        blocks_per_write=args.blocks_per_write,
        iterations=args.iterations,
        warmups=args.warmups,
        rounds=args.rounds,
        writer_poll_s=args.writer_poll_s,
        receiver_poll_s=args.receiver_poll_s,
        post_on_finish=args.post_on_finish,
        p_tp=args.p_tp,
    )
    default = ALL_KINDS if args.p_tp == 1 else TP_KINDS
    names = [k for k in (args.kinds or ",".join(default)).split(",") if k]
    kinds: tuple[AnyKind, ...] = tuple(k for k in ALL_KINDS if k in names)
    if not kinds or any(k not in ALL_KINDS for k in names):
        print(f"error: --kinds must be a subset of {ALL_KINDS}", file=sys.stderr)
        return 2
    try:
        load_before = os.getloadavg()
        data = run_transfer(spec, kinds)
        data["loadavg_before_after"] = [load_before, os.getloadavg()]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.result_file:
        write_json(args.result_file, data)
    print(json.dumps({k: v for k, v in data.items() if k != "rounds"}, indent=2))
    return 0
