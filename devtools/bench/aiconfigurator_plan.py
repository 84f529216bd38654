"""aiconfigurator's answer to ``disagg-bench plan``'s question: the fewest GPUs that serve a
request rate within a TTFT and TPOT bound, from its ``cli_recommend`` (its ``aiconfigurator cli
recommend``).

Who runs it: :mod:`bench.plan_cmd`, with the Python of an environment where ``aiconfigurator``
(package index) is installed (``--aiconfigurator-python``), since its dependencies are not the
router's. It imports nothing of this repository and prints one JSON object:

- ``disagg_tp``: of its top disaggregated replicas (one per D parallelism), the one with the
  fewest GPUs whose P and D both run at ``--tp`` (the planner's instances), as many replicas as
  the rate needs; None when none of them does;
- ``disagg``: the same at any parallelism;
- ``chosen``: what it recommends with every parallelism and serving mode it knows.

Its figures are its static estimates (no queueing simulation); a row whose estimate misses the
bound is not taken (it returns the nearest rows when none meets the TPOT).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

_COLUMNS = {
    "(p)workers": "prefill",
    "(p)tp": "prefill_tp",
    "(d)workers": "decode",
    "(d)tp": "decode_tp",
    "(d)bs": "decode_batch",
    "tp": "tp",
    "bs": "batch",
    "num_total_gpus": "gpus_per_replica",
    "request_rate": "rate_per_replica",
    "ttft": "ttft_ms",
    "tpot": "tpot_ms",
    "tokens/s/gpu": "tokens_per_s_per_gpu",
}


def _plain(value: Any) -> Any:
    """A frame's cell as a JSON value (numpy's scalars have ``item``)."""
    return value.item() if hasattr(value, "item") else value


def _row(frame: Any, index: int, rate: float, mode: str) -> dict[str, Any]:
    """One row of a result frame in the planner's words, with the replicas ``rate`` needs."""
    found = {new: _plain(frame[old].iloc[index]) for old, new in _COLUMNS.items() if old in frame}
    replicas = math.ceil(rate / found["rate_per_replica"])
    return {
        "mode": mode,
        **found,
        "replicas": replicas,
        "gpus": replicas * found["gpus_per_replica"],
    }


def recommend(args: argparse.Namespace) -> dict[str, Any]:
    from aiconfigurator.cli.api import cli_recommend

    result = cli_recommend(
        args.model,
        args.system,
        target_request_rate=args.rate,
        backend=args.backend,
        database_mode="SILICON",
        isl=args.isl,
        osl=args.osl,
        ttft=args.ttft,
        tpot=args.tpot,
        top_n=10,
    )
    frame = result.best_configs.get("disagg")
    rows = [] if frame is None else [_row(frame, i, args.rate, "disagg") for i in range(len(frame))]
    within = [r for r in rows if r["ttft_ms"] <= args.ttft and r["tpot_ms"] <= args.tpot]
    at_tp = [r for r in within if r["prefill_tp"] == r["decode_tp"] == args.tp]
    chosen = result.best_configs[result.chosen_exp]
    return {
        "disagg_tp": min(at_tp, key=lambda r: r["gpus"]) if at_tp else None,
        "disagg": min(within, key=lambda r: r["gpus"]) if within else None,
        "chosen": _row(chosen, 0, args.rate, result.chosen_exp),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--system", required=True, help="e.g. h200_sxm")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--tp", type=int, default=1, help="P's and D's tensor parallel size")
    parser.add_argument("--isl", type=int, required=True)
    parser.add_argument("--osl", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--ttft", type=float, required=True, help="ms")
    parser.add_argument("--tpot", type=float, required=True, help="ms")
    args = parser.parse_args(argv)
    from importlib.metadata import version

    data = {"estimator": f"aiconfigurator {version('aiconfigurator')}", **recommend(args)}
    json.dump(data, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
