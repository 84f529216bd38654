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
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.emulated_stack import start_emulated
from bench.scenarios import SweepSpec, run_scenarios

METRICS = ("mean_ttft_ms", "mean_tpot_ms")


def _key(row: dict[str, Any]) -> tuple[str, int, float, int]:
    return (row["stack"], row["input_len"], row["fraction"], row["rep"])


def point_errors(
    real: list[dict[str, Any]], emulated: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per point present in both runs: the real and emulated means and their relative error."""
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
            cell[f"error_{name}"] = (a / b - 1) if a and b else None
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
    spec: SweepSpec, stacks: tuple[str, ...], out: Path, work: Path, profile: str = "cpu-tiny"
) -> dict[str, Any]:
    """Both sweeps (real first), then the comparison; the twins run ``profile`` (a profile's
    name or file)."""
    real = run_scenarios(spec, stacks, out / "real", work / "real")
    same_load = replace(spec, given_capacity_rps=_capacities(real["capacities"]))
    starter = partial(start_emulated, profile=profile, pin_processes=spec.pin_processes)
    emulated = run_scenarios(same_load, stacks, out / "emulated", work / "emulated", starter)
    points = point_errors(real["rows"], emulated["rows"])
    ratios = ratio_errors(points, spec)
    errors = [abs(p[f"error_{m}"]) for p in points for m in METRICS if p[f"error_{m}"] is not None]
    return {
        "stacks": list(stacks),
        "errors": {"real": real["errors"], "emulated": emulated["errors"]},
        "points": points,
        "ratios": ratios,
        "capacities": capacity_errors(real["capacities"], emulated["capacities"]),
        "summary": {
            "emulator_cpu_point_error_max": round(max(errors), 3) if errors else None,
            "emulator_cpu_ratio_error_max": (
                round(max(abs(r["error"]) for r in ratios), 3) if ratios else None
            ),
        },
    }
