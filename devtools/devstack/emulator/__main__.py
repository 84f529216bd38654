"""``python -m devstack.emulator``: serve an emulated fleet until interrupted (SIGINT/SIGTERM).

Prints one JSON line with the router's instance entries of both roles once every engine serves
(and, with ``--control-port``, serves ``/health``, ``/instances`` and ``/stats`` there).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

from devstack.emulator.fleet import Fleet, FleetSpec
from devstack.emulator.profile import load_profile, profile_option


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.emulator", description=__doc__)
    parser.add_argument(
        "--profile", type=profile_option, default="cpu-tiny", help="a profile name or file"
    )
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="wall seconds per emulated s")
    parser.add_argument("--transfer-mode", choices=("push", "pull"), default="push")
    parser.add_argument("--decode-num-blocks", type=int, help="D's KV cache in blocks")
    parser.add_argument("--tokenizer", help="the served model's tokenizer directory")
    parser.add_argument("--no-kv-events", action="store_true")
    parser.add_argument("--control-port", type=int)
    parser.add_argument(
        "--cpu-cores",
        type=_cores,
        default=(),
        help="comma-separated cores of the P engines then the D engines: each spends its steps"
        " there instead of sleeping, as work at the profile's work_rate where it has one, else"
        " as CPU time (default: none, every engine sleeps)",
    )
    args = parser.parse_args(argv)
    spec = FleetSpec(
        load_profile(args.profile),
        args.prefill,
        args.decode,
        scale=args.scale,
        decode_num_blocks=args.decode_num_blocks,
        transfer_mode=args.transfer_mode,
        tokenizer_dir=args.tokenizer,
        kv_events=not args.no_kv_events,
        control_port=args.control_port,
        cpu_cores=args.cpu_cores,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Fleet(spec) as fleet:
        both = {"prefill": fleet.instances("prefill"), "decode": fleet.instances("decode")}
        print(json.dumps(both), flush=True)
        stop.wait()
    return 0


def _cores(text: str) -> tuple[int, ...]:
    """``--cpu-cores``: comma-separated CPU numbers, each >= 0 (argparse turns the error into a
    usage message)."""
    try:
        cores = tuple(int(core) for core in text.split(",") if core.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of cores: {text!r}") from None
    if any(core < 0 for core in cores):
        raise argparse.ArgumentTypeError(f"a core is a number >= 0, got {text!r}")
    return cores


if __name__ == "__main__":
    raise SystemExit(main())
