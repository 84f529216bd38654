"""``disagg-bench scenarios`` (sweep + report) and ``bench report`` (re-render only)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import render
from bench.results import write_json
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
    parser.add_argument("--rates", default=",".join(f"{x:g}" for x in d.rates))
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--prefix-len", type=int, default=d.prefix_len)
    parser.add_argument("--seconds-per-point", type=float, default=d.seconds_per_point)
    parser.add_argument("--min-requests", type=int, default=d.min_requests)
    parser.add_argument("--max-requests", type=int, default=d.max_requests)
    parser.add_argument("--num-warmups", type=int, default=d.num_warmups)
    parser.add_argument(
        "--point-time-limit",
        type=float,
        default=d.point_time_limit_s,
        help="seconds per point; unfinished requests then fail, and a point that completed "
        "nothing ends that stack's sweep",
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


def scenarios_command(args: argparse.Namespace) -> int:
    stacks = tuple(s for s in args.stacks.split(",") if s)
    unknown = [s for s in stacks if s not in STACKS]
    if unknown or not stacks:
        print(f"error: --stacks: unknown {unknown}, choose from {STACKS}", file=sys.stderr)
        return 2
    spec = SweepSpec(
        input_lens=_ints(args.input_lens),
        rates=_floats(args.rates),
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        seconds_per_point=args.seconds_per_point,
        min_requests=args.min_requests,
        max_requests=args.max_requests,
        num_warmups=args.num_warmups,
        point_time_limit_s=args.point_time_limit,
        burstiness=args.burstiness,
        seed=args.seed,
    )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-scenarios-"))
    command = "disagg-bench " + shlex.join(sys.argv[2:])
    previous_path = args.out_dir / "scenarios.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else None

    def save(partial: dict[str, Any]) -> dict[str, Any]:
        partial = {**partial, "command": command, "work_dir": str(work)}
        if args.merge:
            partial = merge_previous(partial, previous)
        write_json(previous_path, partial)
        render(args.out_dir, command)
        return partial

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
    keys = ("stack", "input_len", "rate", "num_requests", "metrics", "errors", "ttft_breakdown_ms")
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
