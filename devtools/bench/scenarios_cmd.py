"""``disagg-bench scenarios`` (sweep + report) and ``bench report`` (re-render only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.report import render
from bench.results import log_folder, recorded_command, write_json
from bench.scenarios import STACKS, SweepSpec, merge_previous, run_scenarios

DEFAULT_OUT = Path("docs/benchmarks")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_scenarios_arguments(parser: argparse.ArgumentParser) -> None:
    d = SweepSpec()
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"subset of {STACKS}")
    parser.add_argument("--input-lens", default=",".join(str(x) for x in d.input_lens))
    parser.add_argument(
        "--fractions",
        default=",".join(f"{x:g}" for x in d.fractions),
        help="load points as fractions of each stack's measured capacity at each input length",
    )
    parser.add_argument("--light-fraction", type=float, default=d.light_fraction)
    parser.add_argument("--loaded-fraction", type=float, default=d.loaded_fraction)
    parser.add_argument(
        "--repetitions",
        type=int,
        default=d.repetitions,
        help="runs of the light and loaded points (their ratios get a spread)",
    )
    parser.add_argument("--capacity-concurrency", type=int, default=d.capacity_concurrency)
    parser.add_argument(
        "--capacity-requests",
        type=int,
        default=d.capacity_requests,
        help="closed-loop requests that measure a stack's capacity per input length",
    )
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--prefix-len", type=int, default=d.prefix_len)
    parser.add_argument("--seconds-per-point", type=float, default=d.seconds_per_point)
    parser.add_argument("--min-requests", type=int, default=d.min_requests)
    parser.add_argument("--max-requests", type=int, default=d.max_requests)
    parser.add_argument(
        "--num-warmups", type=int, default=d.num_warmups, help="unmeasured requests per point"
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds to wait for idle instances before each point",
    )
    parser.add_argument(
        "--point-time-limit",
        type=float,
        default=d.point_time_limit_s,
        help="seconds per point; unfinished requests then fail, and a point that completed "
        "nothing ends that stack's sweep",
    )
    parser.add_argument(
        "--pin-processes",
        action="store_true",
        help="whole instance processes on their cores; routers and load generator on core 1",
    )
    parser.add_argument("--burstiness", type=float, default=d.burstiness)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work-dir", type=Path, help="instance logs (default: a temp dir)")
    parser.add_argument(
        "--merge", action="store_true", help="keep other stacks' results from scenarios.json"
    )


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="rebuild scenarios.json rows from runs/*.json (after an interrupted sweep)",
    )


def sweep_spec(args: argparse.Namespace) -> SweepSpec:
    """The sweep the parsed scenario flags describe (``ValueError`` naming a bad one)."""
    return SweepSpec(
        input_lens=_ints(args.input_lens),
        fractions=_floats(args.fractions),
        light_fraction=args.light_fraction,
        loaded_fraction=args.loaded_fraction,
        repetitions=args.repetitions,
        capacity_concurrency=args.capacity_concurrency,
        capacity_requests=args.capacity_requests,
        idle_timeout_s=args.idle_timeout,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        seconds_per_point=args.seconds_per_point,
        min_requests=args.min_requests,
        max_requests=args.max_requests,
        num_warmups=args.num_warmups,
        point_time_limit_s=args.point_time_limit,
        burstiness=args.burstiness,
        seed=args.seed,
        pin_processes=args.pin_processes,
    )


def scenarios_command(args: argparse.Namespace) -> int:
    stacks = tuple(s for s in args.stacks.split(",") if s)
    unknown = [s for s in stacks if s not in STACKS]
    if unknown or not stacks:
        print(f"error: --stacks: unknown {unknown}, choose from {STACKS}", file=sys.stderr)
        return 2
    try:
        spec = sweep_spec(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = recorded_command(sys.argv[1:])
    previous_path = args.out_dir / "scenarios.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else None

    def save(partial: dict[str, Any]) -> dict[str, Any]:
        partial = {**partial, "command": command}
        if args.merge:
            partial = merge_previous(partial, previous)
        write_json(previous_path, partial)
        render(args.out_dir, command)
        return partial

    with log_folder(args.work_dir, "bench-scenarios-") as work:
        data = save(run_scenarios(spec, stacks, args.out_dir, work, on_progress=save))
    summary = render(args.out_dir, command)
    print(json.dumps(summary, indent=2))
    for stack, error in data["errors"].items():
        if stack not in stacks:
            continue
        print(f"{stack}: {error[:500]}", file=sys.stderr)
    return 0 if not any(s in data["errors"] for s in stacks) else 1


def rows_from_runs(out_dir: Path) -> list[dict[str, Any]]:
    """The summary rows stored in each per-point file ``runs/*.json``."""
    keys = (
        "stack",
        "input_len",
        "fraction",
        "rep",
        "capacity_rps",
        "rate",
        "num_requests",
        "idle_wait_s",
        "alone",
        "metrics",
        "errors",
        "ttft_breakdown_ms",
    )
    rows = []
    for path in sorted((out_dir / "runs").glob("*.json")):
        data = json.loads(path.read_text())
        rows.append({k: data[k] for k in keys if k in data})
    return rows


def report_command(args: argparse.Namespace) -> int:
    scen_path = args.out_dir / "scenarios.json"
    command = "(no scenarios.json)"
    scen: dict[str, Any] = {}
    if scen_path.exists():
        scen = json.loads(scen_path.read_text())
        command = scen.get("command", command)
    if args.from_runs:
        rows = rows_from_runs(args.out_dir)
        ran = {r["stack"] for r in rows}
        stacks = [s for s in STACKS if s in ran or s in scen.get("stacks", [])]
        write_json(scen_path, {**scen, "rows": rows, "stacks": stacks, "rebuilt_from_runs": True})
    print(json.dumps(render(args.out_dir, command), indent=2))
    return 0
