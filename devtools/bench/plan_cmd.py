"""``disagg-bench plan``: flags, the search, JSON + markdown.

Who calls it: :mod:`bench.cli`. The search itself is :mod:`bench.plan`; aiconfigurator's
recommendation beside it, where an environment with aiconfigurator is given, comes from
:mod:`bench.aiconfigurator_plan`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.plan import MODES, PlanSpec, Slo, Workload, aiconfigurator_answer, run_plan
from bench.results import recorded_command, run_in_work_dir, write_outputs
from devstack.emulator.profile import profile_option


def _parsed(kind: type[Workload] | type[Slo]) -> Any:
    def parse(text: str) -> Workload | Slo:
        try:
            return kind.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m for m in text.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes: expected some of {', '.join(MODES)}")
    return modes


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        type=profile_option,
        required=True,
        help="the emulator's profile (name or file)",
    )
    parser.add_argument(
        "--workload", type=_parsed(Workload), required=True, help="isl=4096,osl=512,rate=4"
    )
    parser.add_argument(
        "--slo", type=_parsed(Slo), required=True, help="ttft=1000,tpot=30[,percentile=90] (ms)"
    )
    defaults = PlanSpec("", Workload(1, 1, 1.0), Slo(1.0, 1.0))
    parser.add_argument("--max-instances", type=int, default=defaults.max_instances)
    parser.add_argument(
        "--gpus-per-instance", type=int, default=defaults.gpus_per_instance, help="its TP"
    )
    parser.add_argument("--modes", type=_modes, default=defaults.modes, help="push,pull")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="per shape")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--aiconfigurator-python",
        type=Path,
        help="the Python of an environment with aiconfigurator: its recommendation beside ours",
    )
    parser.add_argument(
        "--aiconfigurator-system",
        default=defaults.aiconfigurator_system,
        help="aiconfigurator's name of the profile's GPU",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="plan.json/.md")
    parser.add_argument("--work-dir", type=Path, help="logs (default: a temp dir)")


def plan_command(args: argparse.Namespace) -> int:
    spec = PlanSpec(
        args.profile,
        args.workload,
        args.slo,
        max_instances=args.max_instances,
        gpus_per_instance=args.gpus_per_instance,
        modes=args.modes,
        requests=args.requests,
        seed=args.seed,
        aiconfigurator_system=args.aiconfigurator_system,
    )
    data = run_in_work_dir(lambda folder: run_plan(spec, folder), args.work_dir, "disagg-plan-")
    if data is None:
        return 1
    if args.aiconfigurator_python is not None:
        try:
            data["aiconfigurator"] = aiconfigurator_answer(spec, args.aiconfigurator_python)
        except subprocess.CalledProcessError as exc:
            print(f"error: aiconfigurator failed: {exc.stderr[-2000:]}", file=sys.stderr)
            return 1
    data["command"] = f".venv/bin/{recorded_command(sys.argv[1:])}"
    out = args.out_dir
    write_outputs(data, format_report(data), out / "plan.json", out / "plan.md")
    return 0


def format_report(data: dict[str, Any]) -> str:
    """plan.md: the command, the answer, then every shape tried."""
    spec, choice = data["spec"], data["choice"]
    w, slo = spec["workload"], spec["slo"]
    pct = f"p{slo['percentile']:g}"
    lines = [
        "# The cheapest fleet for a workload",
        "",
        f"Produced by `{data['command']}`. Profile `{spec['profile']}`; every request "
        f"{w['isl']} prompt and {w['osl']} output tokens, {w['rate']:g} requests/s Poisson; "
        f"SLO: {pct} TTFT ≤ {slo['ttft_ms']:g} ms and {pct} TPOT ≤ {slo['tpot_ms']:g} ms, no "
        f"failure. Each shape ran {spec['requests']} requests on a fresh emulated fleet behind "
        f"our router (P and D by fewest legs in flight); the first {spec['ramp']:g} of them "
        "fill it and are not measured.",
        "",
        _answer(choice, pct),
        "",
        *_aiconfigurator_lines(data.get("aiconfigurator"), spec),
        f"| shape | mode | GPUs | P load | D load | TTFT {pct} ms | TTFT p50 ms "
        f"| TPOT {pct} ms | TPOT p50 ms | failed | SLO |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [_row(r) for r in data["rows"] if r["ran"]]
    lines += ["", *_not_run(data["rows"])]
    return "\n".join(lines) + "\n"


def _answer(choice: dict[str, Any] | None, pct: str) -> str:
    if choice is None:
        return "**No shape tried meets the SLO.**"
    return (
        f"**Cheapest: {choice['prefill']}P{choice['decode']}D, {choice['mode']}, "
        f"{choice['gpus']} GPUs**: TTFT {pct} {choice['ttft_ms']:.0f} ms, TPOT {pct} "
        f"{choice['tpot_ms']:.1f} ms."
    )


def _aiconfigurator_lines(answer: dict[str, Any] | None, spec: dict[str, Any]) -> list[str]:
    """What aiconfigurator recommends for the same question (its static estimates, not a
    percentile of a run): disaggregated at the planner's TP, at any TP, in any mode."""
    if answer is None:
        return []
    tp = spec["gpus_per_instance"]
    at_tp = answer["disagg_tp"]
    parts = [
        f"disaggregated at TP {tp}: {_replicas(at_tp, bold=True)}"
        if at_tp is not None
        else f"no disaggregated replica at TP {tp} among its top ones"
    ]
    if answer.get("disagg") not in (None, at_tp):
        parts.append(f"disaggregated at any TP: {_replicas(answer['disagg'])}")
    parts.append(f"with every parallelism and mode it knows: {_replicas(answer['chosen'])}")
    head = f"{answer['estimator']} (`cli recommend`, its estimates of the mean):"
    return [f"{head} {'; '.join(parts)}.", ""]


def _replicas(row: dict[str, Any], bold: bool = False) -> str:
    """``N x shape = G GPUs (its TTFT, TPOT, ...)`` for one of aiconfigurator's rows."""
    if row["mode"] == "disagg":
        shape = f"{row['prefill']}P{row['decode']}D"
        if row["prefill_tp"] != 1 or row["decode_tp"] != 1:
            shape += f" (P at TP {row['prefill_tp']}, D at TP {row['decode_tp']})"
        more = f", D batch {row['decode_batch']}"
    else:
        shape, more = f"aggregated at TP {row['tp']}", ""
    gpus = f"**{row['gpus']} GPUs**" if bold else f"{row['gpus']} GPUs"
    return (
        f"{row['replicas']} x {shape} = {gpus} (TTFT {row['ttft_ms']:.0f} ms, TPOT "
        f"{row['tpot_ms']:.1f} ms{more}, {row['rate_per_replica']:g} requests/s per replica)"
    )


def _not_run(rows: list[dict[str, Any]]) -> list[str]:
    """The shapes the profile ruled out, by reason, each once (every mode alike)."""
    why: dict[str, list[str]] = {}
    for r in rows:
        name = f"{r['prefill']}P{r['decode']}D"
        if not r["ran"] and name not in why.setdefault(r["why"], []):
            why[r["why"]].append(name)
    lines = []
    if "offered load over capacity" in why:
        lines.append(
            "Not run, the offered load over what the profile says their Ps (P load: the "
            "prefill work over the Ps' time, one prompt at a time each) or Ds (D load: the "
            "output tokens over what the Ds emit with their caches full) can do, so their "
            f"queues only grow: {', '.join(why.pop('offered load over capacity'))}."
        )
    lines += [f"Not run, {reason}: {', '.join(names)}." for reason, names in why.items()]
    return lines


def _row(r: dict[str, Any]) -> str:
    head = (
        f"| {r['prefill']}P{r['decode']}D | {r['mode']} | {r['gpus']} | {r['p_load']:.2f} "
        f"| {r['d_load']:.2f} |"
    )
    return (
        f"{head} {r['ttft_ms']:.0f} | {r['ttft_p50_ms']:.0f} | {r['tpot_ms']:.1f} "
        f"| {r['tpot_p50_ms']:.1f} | {r['failed']} | {'meets' if r['met'] else 'misses'} |"
    )
