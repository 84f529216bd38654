"""How closely the emulator follows real vLLM CPU: the scenario sweep run on real instances and
on their emulated twins (profile ``cpu-tiny``), point by point, in one run.

Who calls it: ``disagg-bench emulator-accuracy`` (:mod:`bench.emulator_accuracy_cmd`). The same
:func:`bench.scenarios.run_scenarios` runs twice with the same sweep (each stack's capacity
measured, then Poisson load at fractions of it, the same prompts and arrivals): once over real
vLLM CPU instances, once over :func:`bench.emulated_stack.start_emulated` at the real run's
offered loads (the points are fractions of the real stack's capacity in both runs; each run's
own closed-loop capacity is compared too). Per point it compares
mean TTFT and TPOT (emulated / real - 1), and per stack and input length the ratios the project
reports (loaded over light TTFT; ours over aggregated TTFT at each fraction).

With ``real_runs`` > 1 the real sweep runs again after the emulated one, at the first real run's
offered loads: the emulated run is then compared with the real runs' mean (the emulated sweep
sits between them in time, so a machine whose speed drifts meets both sides alike), and the real
runs are compared with each other the same way (each later run against the first), which is how
far apart two measurements of the same stack on this machine come out: the floor under the
emulator's errors.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.emulated_stack import start_emulated
from bench.scenarios import SweepSpec, run_scenarios

METRICS = ("mean_ttft_ms", "mean_tpot_ms")
ALONE = {"mean_ttft_ms": "ttft_ms", "mean_tpot_ms": "tpot_ms"}
"""Each metric's name among a point's ``alone`` figures (:mod:`bench.scenarios`: its warm-up
requests, each alone on idle instances just before the point)."""


def _key(row: dict[str, Any]) -> tuple[str, int, float, int]:
    return (row["stack"], row["input_len"], row["fraction"], row["rep"])


def _error(top: float | None, bottom: float | None) -> float | None:
    return (top / bottom - 1) if top and bottom else None


def point_errors(
    real: list[dict[str, Any]], emulated: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per point present in both runs: the real and emulated means and their relative error
    (``error_*``); and each run's requests alone before the point (``*_alone_*``, None where a
    run timed none): how fast the machine ran just then, beside the twins' profile."""
    found = {_key(r): r for r in emulated}
    out = []
    for row in real:
        twin = found.get(_key(row))
        if twin is None:
            continue
        cell: dict[str, Any] = dict(
            zip(("stack", "input_len", "fraction", "rep"), _key(row), strict=True)
        )
        for name in METRICS:
            a, b = twin["metrics"].get(name), row["metrics"].get(name)
            cell[f"real_{name}"], cell[f"emulated_{name}"] = b, a
            cell[f"error_{name}"] = _error(a, b)
            alone_a = twin.get("alone", {}).get(ALONE[name])
            alone_b = row.get("alone", {}).get(ALONE[name])
            cell[f"real_alone_{name}"], cell[f"emulated_alone_{name}"] = alone_b, alone_a
        out.append(cell)
    return out


def ratio_errors(points: list[dict[str, Any]], spec: SweepSpec) -> list[dict[str, Any]]:
    """The sweep's ratios on both runs: loaded / light TTFT per stack and input length, and
    ours / aggregated TTFT per input length and fraction (first repetition)."""
    at = {(p["stack"], p["input_len"], p["fraction"]): p for p in points if p["rep"] == 0}
    out = []
    for (stack, length, fraction), p in at.items():
        if fraction == spec.loaded_fraction and (stack, length, spec.light_fraction) in at:
            light = at[(stack, length, spec.light_fraction)]
            out.append(_ratio(f"{stack} TTFT loaded/light at {length}", p, light))
        if stack == "ours" and ("aggregated", length, fraction) in at:
            base = at[("aggregated", length, fraction)]
            out.append(_ratio(f"TTFT ours/aggregated at {length}, {fraction:g}", p, base))
    return out


def mean_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per point present in every run, its :data:`METRICS` and its ``alone`` figures
    the runs' means (a figure missing from any run is left out)."""
    if len(runs) == 1:
        return runs[0]
    later = [{_key(r): r for r in rows} for rows in runs[1:]]
    out = []
    for row in runs[0]:
        same = [row] + [found[_key(row)] for found in later if _key(row) in found]
        if len(same) < len(runs):
            continue
        metrics = _mean([r["metrics"] for r in same], METRICS)
        alone = _mean([r.get("alone", {}) for r in same], tuple(ALONE.values()))
        out.append({**row, "metrics": metrics, "alone": alone})
    return out


def _mean(found: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, float]:
    """Each of ``names`` that every mapping has, averaged over them."""
    out = {}
    for name in names:
        values = [float(f[name]) for f in found if f.get(name) is not None]
        if len(values) == len(found):
            out[name] = sum(values) / len(values)
    return out


def repeat_errors(runs: list[list[dict[str, Any]]], spec: SweepSpec) -> dict[str, Any]:
    """How far each later real run is from the first, per point and per ratio, as
    :func:`point_errors` and :func:`ratio_errors` measure the emulated run; empty lists for
    one run."""
    points, ratios = [], []
    for rows in runs[1:]:
        found = point_errors(runs[0], rows)
        points += found
        ratios += ratio_errors(found, spec)
    return {"points": points, "ratios": ratios}


def _worst(points: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest point error (TTFT or TPOT) and ratio error, rounded; None where none."""
    errors = [abs(e) for p in points for m in METRICS if (e := p[f"error_{m}"]) is not None]
    return {
        "point": round(max(errors), 3) if errors else None,
        "ratio": round(max(abs(r["error"]) for r in ratios), 3) if ratios else None,
    }


def _ratio(name: str, top: dict[str, Any], bottom: dict[str, Any]) -> dict[str, Any]:
    real = top["real_mean_ttft_ms"] / bottom["real_mean_ttft_ms"]
    emulated = top["emulated_mean_ttft_ms"] / bottom["emulated_mean_ttft_ms"]
    return {"ratio": name, "real": real, "emulated": emulated, "error": emulated / real - 1}


def _capacities(records: list[dict[str, Any]]) -> tuple[tuple[str, int, float], ...]:
    return tuple((c["stack"], c["input_len"], c["request_throughput"]) for c in records)


def capacity_errors(
    real: list[dict[str, Any]], emulated: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per stack and input length: both runs' closed-loop capacity and the relative error."""
    found = {(c["stack"], c["input_len"]): c["request_throughput"] for c in emulated}
    out = []
    for c in real:
        twin = found.get((c["stack"], c["input_len"]))
        if twin is not None and c["request_throughput"] > 0:
            error = twin / c["request_throughput"] - 1
            out.append(
                {
                    "stack": c["stack"],
                    "input_len": c["input_len"],
                    "real_rps": c["request_throughput"],
                    "emulated_rps": twin,
                    "error": error,
                }
            )
    return out


def run_accuracy(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    out: Path,
    work: Path,
    profile: str = "cpu-tiny",
    real_runs: int = 1,
    cpu_steps: bool = False,
) -> dict[str, Any]:
    """The real sweep, the emulated one, then ``real_runs - 1`` more real ones; the twins run
    ``profile`` (a profile's name or file), spending their steps as CPU time on their real
    twins' cores with ``cpu_steps`` (see :func:`bench.emulated_stack.start_emulated`). Then the
    comparison (module docstring)."""
    real = run_scenarios(spec, stacks, out / "real", work / "real")
    same_load = replace(spec, given_capacity_rps=_capacities(real["capacities"]))
    starter = partial(
        start_emulated, profile=profile, pin_processes=spec.pin_processes, cpu_steps=cpu_steps
    )
    emulated = run_scenarios(same_load, stacks, out / "emulated", work / "emulated", starter)
    again = [
        run_scenarios(same_load, stacks, out / f"real-{n}", work / f"real-{n}")
        for n in range(2, real_runs + 1)
    ]
    real_rows = [real["rows"]] + [run["rows"] for run in again]
    points = point_errors(mean_rows(real_rows), emulated["rows"])
    ratios = ratio_errors(points, spec)
    repeats = repeat_errors(real_rows, spec)
    worst, floor = _worst(points, ratios), _worst(repeats["points"], repeats["ratios"])
    summary = {
        "emulator_cpu_point_error_max": worst["point"],
        "emulator_cpu_ratio_error_max": worst["ratio"],
    }
    if again:
        summary["real_repeat_point_error_max"] = floor["point"]
        summary["real_repeat_ratio_error_max"] = floor["ratio"]
    real_errors = [real["errors"]] + [run["errors"] for run in again]
    return {
        "stacks": list(stacks),
        "real_runs": real_runs,
        "cpu_steps": cpu_steps,
        "errors": {"real": _merged(real_errors), "emulated": emulated["errors"]},
        "points": points,
        "ratios": ratios,
        "repeats": repeats,
        "capacities": capacity_errors(real["capacities"], emulated["capacities"]),
        "summary": summary,
    }


def _merged(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The real runs' per-stack errors in one mapping, a later run's under ``<stack> (run n)``."""
    out = dict(errors[0])
    for n, found in enumerate(errors[1:], start=2):
        out.update({f"{stack} (run {n})": error for stack, error in found.items()})
    return out
