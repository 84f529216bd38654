"""How closely the emulator follows real vLLM CPU: the scenario sweep run on real instances and
on their emulated twins (profile ``cpu-tiny``), point by point, in one run.

Who calls it: ``disagg-bench emulator-accuracy`` (:mod:`bench.emulator_accuracy_cmd`). Per
instance group, the real vLLM CPU instances and their twins
(:func:`bench.emulated_stack.start_emulated`) are started once, side by side, each with the
routers the sweep measures, and the sweep (:func:`bench.scenarios.sweep_target`: the stack's
capacity, then Poisson load at fractions of it) runs in turns, one input length at a time:

1. the real pass;
2. the emulated pass, at the real pass's offered loads (the points are fractions of the real
   stack's capacity in both; each pass's own closed-loop capacity is compared too), with the
   same prompts and arrivals;
3. with ``also_sleeping``, the same for twins that sleep through their steps (with
   ``cpu_steps`` the first twins spend them as CPU time): what modelling that CPU changes,
   measured on the same machine minutes apart;
4. with ``real_runs`` > 1, the real pass again, as often, at the same loads and arrivals and
   with prompts of its own (:attr:`bench.scenarios.SweepSpec.prompt_salt`: the instances still
   hold the first pass's prefixes).

A machine whose speed drifts within minutes then meets the real and the emulated figures of a
point alike: the passes of one input length run within a few minutes of each other. Per point
it compares mean TTFT and TPOT (emulated / real - 1) with the real passes' mean, and per stack
and input length the ratios the project reports (loaded over light TTFT; ours over aggregated
TTFT at each fraction). The real passes are compared with each other the same way (each later
one against the first): how far apart two measurements of the same stack on this machine come
out, the floor under the emulator's errors.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.emulated_stack import start_emulated
from bench.scenarios import (
    InstanceGroup,
    SweepSpec,
    group_targets,
    load_generator_pinned,
    stack_error,
    start_devstack,
    sweep_one,
    wanted_groups,
)
from devstack.process import ProcessStartError

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


@dataclass
class _Pass:
    """One pass of the sweep as it fills in, one input length at a time: which instances it
    runs on (``real``, ``emulated``, ``sleeping``), its prompt salt, its rows, capacities and
    per-stack errors."""

    instances: str
    out_dir: Path
    salt: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    capacities: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def sweep(self, targets: dict[str, Target], spec: SweepSpec) -> None:
        """Each target's sweep of ``spec``, but not a stack that stopped early in this pass."""
        for name, target in targets.items():
            if name in self.errors:
                continue
            error = sweep_one(name, target, spec, self.out_dir, self.rows, self.capacities)
            if error is not None:
                self.errors[name] = error


Starter = Callable[[InstanceGroup, Path], Any]


def run_accuracy(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    out: Path,
    work: Path,
    profile: str = "cpu-tiny",
    real_runs: int = 1,
    cpu_steps: bool = False,
    also_sleeping: bool = False,
    starters: dict[str, Starter] | None = None,
) -> dict[str, Any]:
    """The passes in turns (module docstring), then the comparison. The twins run ``profile``
    (a profile's name or file), spending their steps as CPU time on their real twins' cores
    with ``cpu_steps`` (:func:`bench.emulated_stack.start_emulated`); ``also_sleeping``: a
    second set of twins that sleep through their steps runs right after them, compared the
    same way. ``starters``: what starts a group's ``real`` instances, its ``emulated`` twins
    and its ``sleeping`` ones (default: vLLM CPU and the emulator); tests pass fakes."""
    twin = partial(start_emulated, profile=profile, pin_processes=spec.pin_processes)
    starters = starters or {
        "real": partial(start_devstack, pin_processes=spec.pin_processes),
        "emulated": partial(twin, cpu_steps=cpu_steps),
        "sleeping": partial(twin, cpu_steps=False),
    }
    passes = {"real": _Pass("real", out / "real"), "emulated": _Pass("emulated", out / "emulated")}
    if also_sleeping:
        passes["sleeping"] = _Pass("sleeping", out / "sleeping")
    for n in range(2, real_runs + 1):
        passes[f"real-{n}"] = _Pass("real", out / f"real-{n}", salt=f"real-{n}/")
    used = {found.instances: starters[found.instances] for found in passes.values()}
    with load_generator_pinned(spec):
        for group, wanted in wanted_groups(stacks):
            try:
                with ExitStack() as es:
                    targets = {
                        name: es.enter_context(
                            group_targets(group, wanted, start, work / name / group, spec)
                        )
                        for name, start in used.items()
                    }
                    _in_turns(targets, spec, list(passes.values()))
            except (OSError, RuntimeError, ProcessStartError) as exc:
                for found in passes.values():
                    for name in wanted:
                        found.errors.setdefault(name, stack_error(exc))
    return _compare(passes, spec, stacks, real_runs, cpu_steps)


def _in_turns(targets: dict[str, dict[str, Target]], spec: SweepSpec, passes: list[_Pass]) -> None:
    """Per input length: the first (real) pass, then every other pass in order at its offered
    loads, each on its instances and with its prompt salt."""
    first, *rest = passes
    for input_len in spec.input_lens:
        one = replace(spec, input_lens=(input_len,))
        first.sweep(targets[first.instances], one)
        same_load = replace(one, given_capacity_rps=_capacities(first.capacities))
        for found in rest:
            found.sweep(targets[found.instances], replace(same_load, prompt_salt=found.salt))


def _compare(
    passes: dict[str, _Pass],
    spec: SweepSpec,
    stacks: tuple[str, ...],
    real_runs: int,
    cpu_steps: bool,
) -> dict[str, Any]:
    """Each twins' pass against the real passes' mean, and the real passes against each other."""
    reals = [found for found in passes.values() if found.instances == "real"]
    emulated = passes["emulated"]
    real_rows = [found.rows for found in reals]
    reference = mean_rows(real_rows)
    points = point_errors(reference, emulated.rows)
    ratios = ratio_errors(points, spec)
    repeats = repeat_errors(real_rows, spec)
    worst, floor = _worst(points, ratios), _worst(repeats["points"], repeats["ratios"])
    summary = {
        "emulator_cpu_point_error_max": worst["point"],
        "emulator_cpu_ratio_error_max": worst["ratio"],
    }
    if real_runs > 1:
        summary["real_repeat_point_error_max"] = floor["point"]
        summary["real_repeat_ratio_error_max"] = floor["ratio"]
    data: dict[str, Any] = {
        "stacks": list(stacks),
        "real_runs": real_runs,
        "cpu_steps": cpu_steps,
        "errors": {
            "real": _merged([found.errors for found in reals]),
            "emulated": emulated.errors,
        },
        "points": points,
        "ratios": ratios,
        "repeats": repeats,
        "capacities": capacity_errors(reals[0].capacities, emulated.capacities),
        "summary": summary,
    }
    if "sleeping" in passes:
        _add_sleeping(data, passes["sleeping"], reference, spec)
    return data


def _add_sleeping(
    data: dict[str, Any], sleeping: _Pass, reference: list[dict[str, Any]], spec: SweepSpec
) -> None:
    """The sleeping twins' pass against the real passes' mean (``reference``), into ``data``:
    its points and ratios, its errors and its two summary keys."""
    points = point_errors(reference, sleeping.rows)
    ratios = ratio_errors(points, spec)
    data["sleeping"] = {"points": points, "ratios": ratios}
    data["errors"]["sleeping"] = sleeping.errors
    worst = _worst(points, ratios)
    data["summary"]["emulator_sleeping_point_error_max"] = worst["point"]
    data["summary"]["emulator_sleeping_ratio_error_max"] = worst["ratio"]


def _merged(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The real runs' per-stack errors in one mapping, a later run's under ``<stack> (run n)``."""
    out = dict(errors[0])
    for n, found in enumerate(errors[1:], start=2):
        out.update({f"{stack} (run {n})": error for stack, error in found.items()})
    return out
