"""``disagg-bench emulator-accuracy``: the scenario flags, both sweeps, JSON + markdown.

Who calls it: :mod:`bench.cli`. The run and the comparison are :mod:`bench.emulator_accuracy`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.emulated_stack import twin_cores
from bench.emulator_accuracy import run_accuracy
from bench.profile_fit import FitSpec, run_fit
from bench.results import recorded_command, run_in_work_dir, write_outputs
from bench.scenarios_cmd import add_scenarios_arguments, sweep_spec

ACCURACY_STACKS = "ours,aggregated"


FITTED_PROFILE = "emulator-accuracy-profile.json"
"""With ``--fit-first``: the profile fitted in the run, beside its report in ``--out-dir``."""


def add_emulator_accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenarios_arguments(parser)
    parser.set_defaults(stacks=ACCURACY_STACKS, repetitions=1, fractions="0.3,0.9")
    parser.add_argument(
        "--fit-first",
        action="store_true",
        help="fit the twins' profile to vLLM CPU in this run first (as fit-profile does), so "
        f"both sweeps meet the machine in one state; written to --out-dir/{FITTED_PROFILE}",
    )
    parser.add_argument(
        "--real-runs",
        type=_at_least_one,
        default=1,
        help="run the real sweep this many times (at each input length, the later ones right "
        "after the emulated one, at the same loads): the emulator is compared with their mean, "
        "and the real runs with each other, which is how far this machine lets two "
        "measurements agree (default 1)",
    )
    parser.add_argument(
        "--cpu-steps",
        action="store_true",
        help="with --pin-processes: each emulated engine spends its steps as CPU time on its "
        "real twin's core (P's, D's), which it then shares with what runs there (the router, "
        "the load generator) as the twin does; without it the engines sleep through their steps",
    )
    parser.add_argument(
        "--also-sleeping",
        action="store_true",
        help="with --cpu-steps: at each input length, right after those twins, run twins that "
        "sleep through their steps, compared with the real runs the same way, so the report "
        "shows what spending the steps as CPU changes on the machine of that minute",
    )


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def emulator_accuracy_command(args: argparse.Namespace) -> int:
    stacks = tuple(s for s in args.stacks.split(",") if s)
    try:
        spec = sweep_spec(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cpu_steps and not spec.pin_processes:
        print("error: --cpu-steps needs --pin-processes (the twins' cores)", file=sys.stderr)
        return 2
    if args.also_sleeping and not args.cpu_steps:
        print("error: --also-sleeping needs --cpu-steps (else both twins sleep)", file=sys.stderr)
        return 2
    runs = args.out_dir / "emulator-accuracy"
    fitted = args.out_dir / FITTED_PROFILE if args.fit_first else None

    def run(work: Path) -> dict[str, Any]:
        fit = _fit(work, fitted, spec.pin_processes) if fitted is not None else None
        profile = str(fitted) if fitted is not None else "cpu-tiny"
        found = run_accuracy(
            spec, stacks, runs, work, profile, args.real_runs, args.cpu_steps, args.also_sleeping
        )
        return {**found, "fit": fit}

    data = run_in_work_dir(run, args.work_dir, "bench-accuracy-")
    if data is None:
        return 1
    data["command"] = recorded_command(sys.argv[1:])
    out = args.out_dir
    write_outputs(
        data, format_report(data), out / "emulator-accuracy.json", out / "emulator-accuracy.md"
    )
    return 0 if not any(data["errors"].values()) else 1


def _fit(work: Path, path: Path, pin_processes: bool) -> dict[str, Any]:
    """Fit ``cpu-tiny``'s step model to vLLM CPU now and write the profile to ``path``; the
    fit's rows and coefficients, for the report."""
    found = run_fit(FitSpec(), work / "fit", pin_processes=pin_processes)
    source = (
        "Fitted by `disagg-bench emulator-accuracy --fit-first` just before its sweeps, as "
        "`disagg-bench fit-profile` fits cpu-tiny (the report lists the rows)."
    )
    profile = replace(found["profile"], name="cpu-tiny-same-run", source=source)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return {"profile": asdict(profile), "rows": found["rows"]}


def _fit_line(fit: dict[str, Any] | None) -> str:
    if fit is None:
        return "Twins' profile: `cpu-tiny` (devtools/devstack/emulator/profiles/cpu-tiny.json)."
    worst = max(abs(r["error"]) for r in fit["rows"])
    return (
        f"Twins' profile: fitted in this run before the sweeps ({FITTED_PROFILE}), "
        f"{len(fit['rows'])} rows within {100 * worst:.0f} %."
    )


def _work_rate(fit: dict[str, Any] | None) -> float | None:
    """The fitted profile's ``work_rate``: None without a fit in the run, or an older profile."""
    if fit is None:
        return None
    rate: float | None = fit["profile"].get("work_rate")
    return rate


def _steps_line(cpu_steps: bool, rate: float | None) -> str:
    """How the twins passed their steps; ``rate``: the profile's ``work_rate``, if it has one."""
    if not cpu_steps:
        return "The twins slept through their steps (no core of theirs is shared)."
    _, (p_core, d_core) = twin_cores(aggregated=False, cpu_steps=True)
    spent = (
        "as CPU time"
        if rate is None
        else f"as work (the profile's {rate:.0f} pieces per second, the machine's speed at the "
        "fit, so a core running slower now stretches them as it stretches vLLM's steps)"
    )
    return (
        f"The twins spent their steps {spent} on their real twins' cores (`--cpu-steps`): "
        f"P's on core {p_core}, D's on core {d_core} beside the router and the load generator, "
        "as the real D runs there."
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def _point_row(p: dict[str, Any]) -> str:
    """A point's table row: TTFT and TPOT of the reference and the compared run, and error."""
    return (
        f"| {p['stack']} | {p['input_len']} | {p['fraction']:g} | "
        f"{p['real_mean_ttft_ms']:.1f} / {p['emulated_mean_ttft_ms']:.1f} "
        f"({_pct(p['error_mean_ttft_ms'])}) | {p['real_mean_tpot_ms']:.2f} / "
        f"{p['emulated_mean_tpot_ms']:.2f} ({_pct(p['error_mean_tpot_ms'])}) |"
    )


def _alone_lines(points: list[dict[str, Any]]) -> list[str]:
    """Where the points timed requests alone before them: those figures in both runs (the
    emulated ones follow the twins' profile; the real ones, the machine's speed just then)."""
    timed = [p for p in points if p.get("real_alone_mean_tpot_ms") is not None]
    if not timed:
        return []
    lines = [
        "",
        "Each point starts with its warm-up request alone on idle instances. The emulated one "
        "follows the twins' profile; the real one shows how fast the machine ran just before "
        "the point.",
        "",
        "| stack | input | x capacity | alone TTFT ms real / emulated "
        "| alone TPOT ms real / emulated |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in timed:
        lines.append(
            f"| {p['stack']} | {p['input_len']} | {p['fraction']:g} | "
            f"{p['real_alone_mean_ttft_ms']:.1f} / {p['emulated_alone_mean_ttft_ms']:.1f} | "
            f"{p['real_alone_mean_tpot_ms']:.2f} / {p['emulated_alone_mean_tpot_ms']:.2f} |"
        )
    return lines


def _point_table(points: list[dict[str, Any]], words: tuple[str, str, str]) -> list[str]:
    """The points as a table; ``words``: what the reference run, the compared run and their
    relative difference are called in its header."""
    top, bottom, diff = words
    return [
        f"| stack | input | x capacity | TTFT ms {top} / {bottom} ({diff}) "
        f"| TPOT ms {top} / {bottom} ({diff}) |",
        "| --- | --- | --- | --- | --- |",
        *(_point_row(p) for p in points),
    ]


def _ratio_table(ratios: list[dict[str, Any]], words: tuple[str, str, str]) -> list[str]:
    """The ratios as a table, after a blank line; ``words`` as in :func:`_point_table`."""
    top, bottom, diff = words
    return [
        "",
        f"| ratio | {top} | {bottom} | {diff} |",
        "| --- | --- | --- | --- |",
        *(
            f"| {r['ratio']} | {r['real']:.3f} | {r['emulated']:.3f} | {_pct(r['error'])} |"
            for r in ratios
        ),
    ]


def _sleeping_lines(data: dict[str, Any]) -> list[str]:
    """With ``--also-sleeping``: the sleeping twins against the same real figures."""
    sleeping = data.get("sleeping")
    if not sleeping:
        return []
    lines = [
        "",
        "Twins that slept through their steps, run right after the ones above at each input "
        "length, against the same real figures:",
        "",
    ]
    words = ("real", "sleeping", "error")
    return lines + _point_table(sleeping["points"], words) + _ratio_table(sleeping["ratios"], words)


def _repeat_lines(data: dict[str, Any]) -> list[str]:
    """With more than one real run: how far each later real run came from the first (the
    emulator's errors above are against the runs' mean)."""
    repeats = data.get("repeats") or {"points": [], "ratios": []}
    if not repeats["points"]:
        return []
    lines = [
        "",
        f"The real sweep ran {data['real_runs']} times (at each input length, the later runs "
        "right after the emulated one, at the same loads, with prompts of their own); the real "
        "figures above are their mean. Each later real run against the first:",
        "",
    ]
    words = ("first", "later", "difference")
    return lines + _point_table(repeats["points"], words) + _ratio_table(repeats["ratios"], words)


def format_report(data: dict[str, Any]) -> str:
    """emulator-accuracy.md: the command, per point real vs emulated, the ratios, the keys."""
    lines = [
        "# The emulator against real vLLM CPU",
        "",
        f"Produced by `{data['command']}`: the scenario sweep on real vLLM CPU instances (tiny "
        "model, P on core 0, D on core 1) and on emulated twins (one process), in turns at "
        "each input length, with the same routers, prompts, arrivals and offered loads "
        "(fractions of the real stack's capacity in both runs).",
        "",
        _steps_line(data.get("cpu_steps", False), _work_rate(data.get("fit"))),
        "",
        _fit_line(data.get("fit")),
        "",
    ]
    words = ("real", "emulated", "error")
    lines += _point_table(data["points"], words)
    lines += _alone_lines(data["points"])
    lines += _ratio_table(data["ratios"], words)
    lines += _sleeping_lines(data)
    lines += _repeat_lines(data)
    lines += [
        "",
        "| stack | input | capacity req/s real / emulated (error) |",
        "| --- | --- | --- |",
    ]
    for c in data["capacities"]:
        lines.append(
            f"| {c['stack']} | {c['input_len']} | {c['real_rps']:.2f} / "
            f"{c['emulated_rps']:.2f} ({_pct(c['error'])}) |"
        )
    lines += ["", "Summary:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    return "\n".join(lines) + "\n"
