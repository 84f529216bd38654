"""Turn benchmark JSON into the committed artefacts: markdown table, PNG plots, summary.json.

Who calls it: ``disagg-bench scenarios`` (after the sweep) and ``disagg-bench report`` (re-render
from the JSON files in a directory). Inputs in ``out_dir``: ``scenarios.json`` (rows of the sweep),
optional ``overhead.json``, ``transfer*.json``, ``routing.json``, ``failover.json`` and
``binding.json``. Headline
points: *light* and *loaded* = the sweep's named fractions of capacity at the longest input length
both stacks ran; a ratio is mean(a) / mean(b) over the repetitions, with the per-repetition spread.
TTFT ratios count a failed request at its point's limit. A value that could not be measured is
``null`` with its reason.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.routing import SUMMARY_KEYS, routing_summary
from bench.transfer_spec import key_suffix

Rows = list[dict[str, Any]]


def machine() -> dict[str, Any]:
    """Cores and CPU model of this machine."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu_model": model}


Point = tuple[str, int, float]  # (stack, input length, fraction of capacity)


def _index(rows: Rows) -> dict[Point, list[dict[str, Any]]]:
    """Metrics of each point's repetitions, in repetition order."""
    out: dict[Point, list[tuple[int, dict[str, Any]]]] = {}
    for r in rows:
        out.setdefault((r["stack"], r["input_len"], r["fraction"]), []).append(
            (r.get("rep", 0), r["metrics"])
        )
    return {k: [m for _, m in sorted(v, key=lambda x: x[0])] for k, v in out.items()}


def headline_point(rows: Rows, a: str, b: str, fraction: float) -> int | None:
    """The longest input length where both stacks ran the point at ``fraction``."""
    return _longest_common(_index(rows), a, b, fraction)


def _longest_common(
    idx: dict[Point, list[dict[str, Any]]], a: str, b: str, fraction: float
) -> int | None:
    lens = [k[1] for k in idx if k[0] == a and k[2] == fraction and (b, k[1], fraction) in idx]
    return max(lens) if lens else None


@dataclass(frozen=True)
class Ratio:
    """A ratio of stack ``a`` to stack ``b`` at one point, over paired repetitions.

    ``value`` is mean(a) / mean(b) over the repetitions both ran; ``low``/``high`` are the
    smallest and largest per-repetition ratio (equal with one repetition).
    """

    value: float
    low: float
    high: float
    repetitions: int

    @property
    def wider_than_gap(self) -> bool:
        """The spread is wider than the distance from 1 it would claim."""
        return self.high - self.low > abs(self.value - 1.0)


def pair_ratio(
    rows: Rows, a: str, b: str, metric: str, fraction: float
) -> tuple[Ratio | None, str]:
    """``a``'s ``metric`` over ``b``'s at the headline point; ``None`` with the reason."""
    idx = _index(rows)
    input_len = _longest_common(idx, a, b, fraction)
    if input_len is None:
        return None, f"no point at {fraction:g} x capacity that both {a} and {b} ran"
    reps_a, reps_b = idx[(a, input_len, fraction)], idx[(b, input_len, fraction)]
    pairs = [
        (ma[metric], mb[metric])
        for ma, mb in zip(reps_a, reps_b, strict=False)
        if ma["completed"] and mb["completed"]
    ]
    where = f"input {input_len} tokens, {fraction:g} x capacity"
    if not pairs or any(vb <= 0 for _, vb in pairs):
        return None, f"{b} {metric} is 0 or nothing completed at {where}"
    per_rep = [va / vb for va, vb in pairs]
    mean_a = sum(va for va, _ in pairs) / len(pairs)
    mean_b = sum(vb for _, vb in pairs) / len(pairs)
    r = Ratio(mean_a / mean_b, min(per_rep), max(per_rep), len(pairs))
    why = (
        f"{a} {mean_a:.1f} / {b} {mean_b:.1f} ms ({metric}) at {where}; "
        f"{r.repetitions} repetition(s), per repetition {r.low:.3f}-{r.high:.3f}"
    )
    if r.repetitions > 1 and r.wider_than_gap:
        why += "; the spread is wider than the gap to 1: no difference this run can claim"
    return r, why


def _point_counts(rows: Rows) -> dict[str, list[dict[str, Any]]]:
    """Per stack, each point's offered rate and completed / failed requests."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        m = r["metrics"]
        out.setdefault(r["stack"], []).append(
            {
                "input_len": r["input_len"],
                "fraction": r["fraction"],
                "rep": r.get("rep", 0),
                "rate": r.get("rate"),
                "completed": m["completed"],
                "failed": m["failed"],
            }
        )
    return out


TRANSFER_FILES = {
    "connector_over_bare_nixl_throughput": "transfer.json",
    "connector_over_bare_nixl_throughput_64mib": "transfer-64mib.json",
    "connector_over_bare_nixl_throughput_16k_descriptors": "transfer-16k-descriptors.json",
    "connector_over_bare_nixl_throughput_p_tp2": "transfer-64mib-p-tp2.json",
}
"""summary.json keys from ``disagg-bench transfer`` results (2 MiB and 64 MiB per WRITE in 1,024
descriptors; 4 MiB in 16,384, the descriptor count of a long prompt on a many-layer model; 64 MiB
from two P ranks into one D, ``--p-tp 2``)."""


def _transfer_note(transfer: dict[str, Any], name: str) -> str:
    """How a transfer file's headline ratio was obtained."""
    p_tp = int(transfer.get("spec", {}).get("p_tp", 1))
    size = transfer.get("bytes_per_write")
    descs = transfer.get("descriptors_per_write")
    what = (
        "median-transfer throughput, connector path (PushProducer -> PushConsumer) / "
        "bare NIXL WRITE + notification, same bytes and descriptors"
        if p_tp == 1
        else f"median-iteration throughput, P TP {p_tp} -> D TP 1: {p_tp} P ranks each WRITE "
        "their share of every block into one D, connector NixlEndpoint with its head mapping "
        "/ bare NIXL agent, until D holds every rank's notification"
    )
    return (
        what
        + (f", {size / 2**20:g} MiB per WRITE" if size else "")
        + (f" in {descs} descriptors" if descs else "")
        + (" per rank" if descs and p_tp > 1 else "")
        + f" ({name})"
    )


def _cpu_ratio(saturation: dict[str, Any], router: str) -> tuple[float | None, str]:
    """``router``'s CPU per streamed request over ``vllm-router``'s, both from the closed loop
    of the same overhead run, with how it was obtained (or why it is None)."""
    mine = (saturation.get(router) or {}).get("cpu_ms_per_request")
    theirs = (saturation.get("vllm-router") or {}).get("cpu_ms_per_request")
    if not mine or not theirs:
        return None, f"no closed-loop CPU per request for {router} and vllm-router"
    return mine / theirs, (
        f"CPU ms per streamed request, {router} / vllm-router ({mine:.2f} / {theirs:.2f}), "
        "closed loop of the same overhead run (zero-delay fakes, routers pinned to one core)"
    )


def _cpu_ratio_spread(raw: dict[str, Any], router: str) -> dict[str, Any] | None:
    """Low and high of ``router`` / ``vllm-router`` CPU per request over the overhead run's
    saturation rounds, each ratio within one round (None with fewer than two rounds)."""
    rounds = raw.get("saturation_rounds") or {}
    mine, theirs = rounds.get(router) or [], rounds.get("vllm-router") or []
    ratios = [
        a["cpu_ms_per_request"] / b["cpu_ms_per_request"]
        for a, b in zip(mine, theirs, strict=False)
        if a.get("cpu_ms_per_request") and b.get("cpu_ms_per_request")
    ]
    if len(ratios) < 2:
        return None
    return {"low": min(ratios), "high": max(ratios), "repetitions": len(ratios)}


FAILOVER_KEYS = (
    "migration_resume_over_full_retry",
    "migration_completed_fraction",
    "migration_p_prompt_tokens_max",
)
"""summary.json keys of the D failover matrix (real vLLM 1P2D; docs/benchmarks/failover.md)."""


BIND_KEYS = (
    "d_idle_block_seconds_jit_over_eager",
    "goodput_jit_over_eager_d_kv_bound",
    "ttft_jit_over_eager_light",
    "p_wait_for_d_p50_ms",
    "goodput_adaptive_over_better_d_kv_bound",
    "ttft_jit_over_pull_loaded",
    "ttft_jit_spin_over_pull_loaded",
)
"""summary.json keys of ``disagg-bench bind`` (real vLLM 1P2D; docs/benchmarks/binding.md)."""

TENANT_KEYS = (
    "victim_p99_ttft_noisy_over_alone",
    "victim_p99_ttft_noisy_over_neighbour_at_share",
    "noisy_admitted_over_share",
    "priority_p99_ttft_saturated_over_light",
    "token_limit_error",
)
"""summary.json keys of ``disagg-bench tenants`` (real vLLM 1P1D; docs/benchmarks/tenants.md)."""

EMULATOR_KEYS = ("emulator_cpu_point_error_max", "emulator_cpu_ratio_error_max")
"""summary.json keys of ``disagg-bench emulator-accuracy`` (emulator-accuracy.md)."""

FLEET_KEYS = ("router_cpu_per_request_32p32d_over_1p1d",)
CHURN_KEYS = ("churn_failed_requests",)
"""summary.json keys of ``disagg-bench fleet-scale`` (emulated fleets; fleet-scale.md)."""


@dataclass(frozen=True)
class ResultSource:
    """A benchmark whose result file's ``summary`` holds some summary.json keys."""

    file: str
    keys: tuple[str, ...]
    command: str
    not_run: Mapping[str, str] | None = None


def _take_summary(
    out_dir: Path, source: ResultSource, summary: dict[str, Any], notes: dict[str, str]
) -> None:
    """Copy ``source``'s keys from its result file into ``summary``, each with its note."""
    found = (_load(out_dir / source.file) or {}).get("summary", {})
    for key in source.keys:
        summary[key] = found.get(key)
        missing = (source.not_run or {}).get(key, f"no results ({source.file})")
        notes[key] = f"{source.command} ({source.file})" if found.get(key) is not None else missing


BIND_NOT_RUN = {
    "ttft_jit_over_pull_loaded": "disagg-bench bind ran with --no-pull (no pull stack)",
    "ttft_jit_spin_over_pull_loaded": "disagg-bench bind ran with --no-pull (no pull stack)",
}

RESULT_SOURCES = (
    ResultSource(
        "failover.json", FAILOVER_KEYS, "tests/e2e/test_failover_matrix.py with FAILOVER_OUT"
    ),
    ResultSource("binding.json", BIND_KEYS, "disagg-bench bind", BIND_NOT_RUN),
    ResultSource("tenants.json", TENANT_KEYS, "disagg-bench tenants"),
    ResultSource("emulator-accuracy.json", EMULATOR_KEYS, "disagg-bench emulator-accuracy"),
    ResultSource("fleet-scale.json", FLEET_KEYS, "disagg-bench fleet-scale"),
    ResultSource("churn.json", CHURN_KEYS, "disagg-bench churn"),
)
"""The benchmarks whose summaries report.py copies into summary.json, in order."""


def summarize(out_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """summary.json contents and, per key, how it was obtained (or why it is null)."""
    notes: dict[str, str] = {}
    summary: dict[str, Any] = {}
    scen = _load(out_dir / "scenarios.json")
    rows: Rows = scen["rows"] if scen else []
    errors: dict[str, str] = scen.get("errors", {}) if scen else {}
    sweep = scen.get("sweep", {}) if scen else {}
    named = {
        True: float(sweep.get("loaded_fraction", 0.9)),
        False: float(sweep.get("light_fraction", 0.3)),
    }
    ttft = "mean_ttft_counted_ms"
    pairs = {
        "ttft_push_over_pull_loaded": ("ours", "pull", ttft, True),
        "tpot_push_over_pull_loaded": ("ours", "pull", "mean_tpot_ms", True),
        "ttft_ours_over_vllm_push_loaded": ("ours", "vllm-push", ttft, True),
        "ttft_push_over_aggregated_light": ("ours", "aggregated", ttft, False),
        # extra keys: our push with NIXL's busy-polling progress thread on, as the vLLM
        # connectors run it (the same handicap as pull), to separate mode from spinner
        "ttft_push_spin_over_pull_loaded": ("ours-spin", "pull", ttft, True),
        "ttft_push_spin_over_push_loaded": ("ours-spin", "ours", ttft, True),
    }
    spreads: dict[str, Any] = {}
    for key, (a, b, metric, loaded) in pairs.items():
        if not rows:
            summary[key], notes[key] = None, "no scenario sweep results (scenarios.json missing)"
            continue
        found, why = pair_ratio(rows, a, b, metric, named[loaded])
        if found is None:
            failing = {s: errors[s] for s in (a, b) if s in errors}
            if failing:
                why += "; stack errors: " + "; ".join(f"{s}: {e[:300]}" for s, e in failing.items())
            summary[key] = None
        else:
            summary[key] = found.value
            spreads[key] = {
                "low": found.low,
                "high": found.high,
                "repetitions": found.repetitions,
                "wider_than_gap": found.wider_than_gap,
            }
        notes[key] = why
    summary["spread"] = spreads
    summary["load_points"] = {"light_fraction": named[False], "loaded_fraction": named[True]}
    summary["capacity_rps"] = _capacities(scen.get("capacities", []) if scen else [])
    summary["points"] = _point_counts(rows)

    overhead = _load(out_dir / "overhead.json")
    derived = (overhead or {}).get("derived", {})
    for key, router, field in (
        ("router_added_ms_p50", "ours", "added_e2el_ms_p50"),
        ("router_added_ms_p99", "ours", "added_e2el_ms_p99"),
        ("vllm_router_added_ms_p50", "vllm-router", "added_e2el_ms_p50"),
        ("vllm_router_added_ms_p99", "vllm-router", "added_e2el_ms_p99"),
        ("floor_added_ms_p50", "floor", "added_e2el_ms_p50"),
        ("floor_added_ms_p99", "floor", "added_e2el_ms_p99"),
    ):
        added = derived.get("added", {}).get(router)
        if not added:
            summary[key], notes[key] = None, f"no overhead results for {router}"
            continue
        top = max(added, key=lambda r: r["rate"])
        summary[key] = top[field]
        notes[key] = (
            f"end-to-end latency added over direct-to-backend at {top['rate']:g} req/s "
            f"(open-loop streamed load, zero-delay fakes, same run)"
        )
    saturation = derived.get("saturation", {})
    for key, router in (
        ("router_throughput_over_direct", "ours"),
        ("vllm_router_throughput_over_direct", "vllm-router"),
        ("floor_throughput_over_direct", "floor"),
    ):
        sat = saturation.get(router)
        summary[key] = sat["ratio_to_direct"] if sat else None
        notes[key] = (
            f"closed-loop sustained req/s through {router} / direct, same run"
            if sat
            else f"no saturation results for {router}"
        )

    for key, router in (
        ("router_cpu_over_vllm_router", "ours"),
        ("floor_cpu_over_vllm_router", "floor"),
    ):
        summary[key], notes[key] = _cpu_ratio(saturation, router)
        band = _cpu_ratio_spread((overhead or {}).get("raw", {}), router)
        if band is not None:
            spreads[key] = band

    ours = saturation.get("ours") or {}
    ceiling = ours.get("fakes_limit_over_direct")
    summary["router_throughput_ceiling_over_direct"] = ceiling
    notes["router_throughput_ceiling_over_direct"] = (
        "the most any router could reach in the same closed loop: the fakes share one pinned core "
        "and spent fakes_cpu_ms_per_request of it per routed request (P and D legs), against one "
        "D request direct"
        if ceiling is not None
        else "no fakes' CPU in the overhead results"
    )
    machine_cap = ours.get("machine_limit_over_direct")
    summary["router_throughput_machine_limit_over_direct"] = machine_cap
    notes["router_throughput_machine_limit_over_direct"] = (
        "the most any router could reach on this machine in the same closed loop: the load "
        "generator and the fakes alone spent client_cpu_ms_per_request + fakes_cpu_ms_per_request "
        "of the machine's cores per routed request"
        if machine_cap is not None
        else "no load generator CPU in the overhead results"
    )

    for key, name in TRANSFER_FILES.items():
        transfer = _load(out_dir / name) or {}
        p_tp = int(transfer.get("spec", {}).get("p_tp", 1))
        ratio = transfer.get("connector_over_bare_throughput" + key_suffix(p_tp))
        summary[key] = ratio
        if ratio is None:
            notes[key] = f"no transfer results ({name} missing or one kind failed)"
            continue
        notes[key] = _transfer_note(transfer, name)
    routing = _load(out_dir / "routing.json") or {}
    for key, value in routing_summary(routing).items():
        summary[key] = value
        notes[key] = (
            f"disagg-bench routing, part {SUMMARY_KEYS[key]} (routing.json)"
            if value is not None
            else "no routing results for this part (routing.json)"
        )
    for source in RESULT_SOURCES:
        _take_summary(out_dir, source, summary, notes)
    summary["measured_at"] = time.strftime("%Y-%m-%d", time.gmtime())
    summary["machine"] = machine()
    return summary, notes


def _capacities(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stack and input length (as a string key), the measured capacity in req/s."""
    out: dict[str, dict[str, float]] = {}
    for c in records:
        out.setdefault(c["stack"], {})[str(c["input_len"])] = c["request_throughput"]
    return out


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, json.JSONDecodeError):
        return None


def markdown_table(rows: Rows, stacks: list[str]) -> str:
    """One row per (input length, fraction, repetition); per stack: offered rate, mean / p99
    TTFT with failed requests counted at the point's limit, completed / sent, mean TPOT."""
    by_point = {(r["stack"], r["input_len"], r["fraction"], r.get("rep", 0)): r for r in rows}
    points = sorted({(r["input_len"], r["fraction"], r.get("rep", 0)) for r in rows})
    head = "| input | x capacity | rep | " + " | ".join(
        f"{s} req/s | {s} TTFT mean / p99 | {s} done | {s} TPOT" for s in stacks
    )
    lines = [head + " |", "|---|---|---|" + "---|---|---|---|" * len(stacks)]
    for input_len, fraction, rep in points:
        cells = []
        for s in stacks:
            r = by_point.get((s, input_len, fraction, rep))
            if r is None:
                cells += ["-"] * 4
                continue
            m = r["metrics"]
            cells.append(f"{r['rate']:.3g}")
            cells.append(f"{m['mean_ttft_counted_ms']:.0f} / {m['p99_ttft_counted_ms']:.0f}")
            cells.append(f"{m['completed']}/{m['completed'] + m['failed']}")
            cells.append(f"{m['mean_tpot_ms']:.1f}")
        lines.append(f"| {input_len} | {fraction:g} | {rep} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capacity_table(capacities: list[dict[str, Any]], stacks: list[str]) -> str:
    """Measured capacity (closed loop, req/s) per input length and stack."""
    caps = _capacities(capacities)
    lens = sorted({c["input_len"] for c in capacities})
    lines = ["| input | " + " | ".join(stacks) + " |", "|---|" + "---|" * len(stacks)]
    for n in lens:
        cells = [f"{caps.get(s, {}).get(str(n), float('nan')):.3g}" for s in stacks]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BREAKDOWN_COLUMNS = (
    ("router: accept->legs", "router:disagg_router_ttft_stage_seconds{accept_to_legs_sent}"),
    ("router: prefill", "router:disagg_router_ttft_stage_seconds{prefill}"),
    (
        "router: P done->D token",
        "router:disagg_router_ttft_stage_seconds{prefill_done_to_first_token}",
    ),
    ("router: relay", "router:disagg_router_ttft_stage_seconds{relay_to_client}"),
    ("P queue", "prefill:vllm:request_queue_time_seconds"),
    ("P prefill", "prefill:vllm:request_prefill_time_seconds"),
    ("P TTFT (vLLM)", "prefill:vllm:time_to_first_token_seconds"),
    ("P WRITE", "prefill:disagg_push_write_seconds"),
    ("D queue (KV wait)", "decode:vllm:request_queue_time_seconds"),
    ("D prefill", "decode:vllm:request_prefill_time_seconds"),
    ("D TTFT (vLLM)", "decode:vllm:time_to_first_token_seconds"),
    ("agg. queue", "aggregated:vllm:request_queue_time_seconds"),
    ("agg. prefill", "aggregated:vllm:request_prefill_time_seconds"),
    ("agg. TTFT (vLLM)", "aggregated:vllm:time_to_first_token_seconds"),
)
"""Columns of the TTFT breakdown table: label, ``ttft_breakdown_ms`` key (bench.breakdown).
Queue and prefill are the engine core's stamps; "TTFT (vLLM)" is the API server's (arrival in
the API server until it handles the first token), so their difference is the instance's time
outside its engine core."""


def breakdown_table(rows: Rows, stacks: tuple[str, ...], fractions: tuple[float, ...]) -> str:
    """Mean ms per stage at the named fractions for ``stacks``, a row per repetition."""
    picked = [r for r in rows if r["stack"] in stacks and r["fraction"] in fractions]
    picked.sort(
        key=lambda r: (r["input_len"], r["fraction"], stacks.index(r["stack"]), r.get("rep", 0))
    )
    head = "| input | x capacity | stack | rep | TTFT (client) | " + " | ".join(
        c for c, _ in BREAKDOWN_COLUMNS
    )
    lines = [head + " |", "|---|---|---|---|---|" + "---|" * len(BREAKDOWN_COLUMNS)]
    for r in picked:
        b = r.get("ttft_breakdown_ms", {})
        cells = [f"{b[k]:.1f}" if k in b else "-" for _, k in BREAKDOWN_COLUMNS]
        lines.append(
            f"| {r['input_len']} | {r['fraction']:g} | {r['stack']} | {r.get('rep', 0)} | "
            f"{r['metrics']['mean_ttft_ms']:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot(rows: Rows, stacks: list[str], metric: str, label: str, path: Path) -> None:
    """One panel per input length, ``metric`` (mean over repetitions) against the fraction of
    capacity offered, one line per stack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = _index(rows)
    lens = sorted({k[1] for k in idx})
    if not lens:
        return
    fig, axes = plt.subplots(1, len(lens), figsize=(5 * len(lens), 4), squeeze=False)
    for ax, input_len in zip(axes[0], lens, strict=True):
        for s in stacks:
            pts = sorted(
                (k[2], sum(m[metric] for m in reps) / len(reps))
                for k, reps in idx.items()
                if k[0] == s and k[1] == input_len and all(m["completed"] for m in reps)
            )
            if pts:
                color = f"C{stacks.index(s)}"  # one colour per stack across panels
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s, color=color)
        ax.set_title(f"input {input_len} tokens")
        ax.set_xlabel("offered load (fraction of the stack's measured capacity)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _transfer_section(name: str, transfer: dict[str, Any] | None) -> list[str]:
    """results.md lines for one ``disagg-bench transfer`` result file (none if it is missing)."""
    if not transfer or not transfer.get("rounds"):
        return []
    lines = ["", f"## Transfer (`{name}`)", ""]
    p_tp = int(transfer.get("spec", {}).get("p_tp", 1))
    size, descs = transfer["bytes_per_write"], transfer["descriptors_per_write"]
    lines.append(
        f"{size} bytes in {descs} descriptors per WRITE; per round: median ms per transfer (GB/s)."
        if p_tp == 1
        else f"{size} bytes per iteration: {p_tp} P ranks each WRITE {descs} descriptors (their "
        "share of every block) into one D; per round: median ms per iteration (GB/s)."
    )
    lines += ["", "| round | kind | median ms | GB/s |", "|---|---|---|---|"]
    for r in transfer["rounds"]:
        ms = r.get("median_write_ms", r.get("median_latency_ms", 0.0))
        lines.append(
            f"| {r['round']} | {r['kind']} | {ms:.3f} | {r['median_throughput_gbps']:.3f} |"
        )
    return lines


def _sweep_sections(
    scen: dict[str, Any], rows: Rows, stacks: list[str], named: dict[str, float]
) -> list[str]:
    fractions = (named["light_fraction"], named["loaded_fraction"])
    return [
        "",
        "## Capacity (req/s, closed loop)",
        "",
        capacity_table(scen.get("capacities", []), stacks),
        "",
        "## Sweep (ms; TTFT counts a failed request at the point's limit)",
        "",
        markdown_table(rows, stacks),
        "",
        "![TTFT](ttft_vs_load.png)",
        "",
        "![TPOT](tpot_vs_load.png)",
        "",
        "## TTFT breakdown (mean ms; light and loaded points, each repetition)",
        "",
        breakdown_table(rows, ("ours", "aggregated"), fractions),
    ]


def render(out_dir: Path, command: str) -> dict[str, Any]:
    """Write ``results.md``, the plots and ``summary.json`` into ``out_dir``; return the summary."""
    scen = _load(out_dir / "scenarios.json") or {"rows": [], "stacks": [], "errors": {}}
    rows: Rows = scen["rows"]
    stacks = [s for s in scen.get("stacks", []) if any(r["stack"] == s for r in rows)]
    if rows:
        ttft_label = "mean TTFT, failures at the limit (ms)"
        plot(rows, stacks, "mean_ttft_counted_ms", ttft_label, out_dir / "ttft_vs_load.png")
        plot(rows, stacks, "mean_tpot_ms", "mean TPOT (ms)", out_dir / "tpot_vs_load.png")
    summary, notes = summarize(out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    parts = [
        "# Scenario results",
        "",
        f"Produced by: `{command}`",
        "",
        f"Machine: {summary['machine']['cores']} cores, {summary['machine']['cpu_model']}; "
        f"measured {summary['measured_at']}.",
        "",
        "## Headline (summary.json)",
        "",
        "| key | value | spread over repetitions | how / why null |",
        "|---|---|---|---|",
    ]
    for key, value in summary.items():
        if key not in notes:
            continue
        shown = "null" if value is None else f"{value:.3f}"
        spread = summary["spread"].get(key)
        band = ""
        if spread:
            band = f"{spread['low']:.3f}-{spread['high']:.3f} ({spread['repetitions']})"
        parts.append(f"| `{key}` | {shown} | {band} | {notes[key]} |")
    if rows:
        parts += _sweep_sections(scen, rows, stacks, summary["load_points"])
    overhead = _load(out_dir / "overhead.json")
    if overhead:
        from bench.overhead import format_report

        parts += ["", "## Router overhead (zero-delay fakes; `overhead.json`)", ""]
        parts.append(format_report(overhead["derived"]))
        if "loadavg_before_after" in overhead:
            parts += ["", f"Load average before / after: {overhead['loadavg_before_after']}"]
    for name in TRANSFER_FILES.values():
        parts += _transfer_section(name, _load(out_dir / name))
    if scen.get("errors"):
        parts += ["", "## Stack errors", ""]
        parts += [f"- `{s}`: {e[:500]}" for s, e in scen["errors"].items()]
    if scen.get("timings"):
        parts += ["", "## Timings (s)", ""]
        parts += [f"- {k}: {v:.0f}" for k, v in scen["timings"].items()]
    (out_dir / "results.md").write_text("\n".join(parts) + "\n")
    return summary
