"""Turn benchmark JSON into the committed artefacts: markdown table, PNG plots, summary.json.

Who calls it: ``disagg-bench scenarios`` (after the sweep) and ``disagg-bench report``
(re-render from the JSON files in a directory). Inputs in ``out_dir``: ``scenarios.json`` (rows of
the sweep), optional ``overhead.json`` and ``transfer.json``. Headline points, stated in the
markdown: *loaded* = the longest input length at the highest rate both stacks completed without
failures; *light* = the longest input length at the lowest rate. Ratios are of mean TTFT / TPOT,
like the AWS comparison. A value that could not be measured is ``null`` with its reason.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.routing import SUMMARY_KEYS, routing_summary

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


def _index(rows: Rows) -> dict[tuple[str, int, float], dict[str, Any]]:
    return {(r["stack"], r["input_len"], r["rate"]): r["metrics"] for r in rows}


def _ok(m: dict[str, Any] | None) -> bool:
    return m is not None and m["completed"] > 0 and m["failed"] == 0


def headline_point(rows: Rows, a: str, b: str, loaded: bool) -> tuple[int, float] | None:
    """(input_len, rate) where both stacks have clean results: longest input, highest (or lowest)
    rate."""
    idx = _index(rows)
    points = sorted(
        {
            (k[1], k[2])
            for k in idx
            if _ok(idx.get((a, k[1], k[2]))) and _ok(idx.get((b, k[1], k[2])))
        }
    )
    if not points:
        return None
    longest = max(p[0] for p in points)
    rates = [p[1] for p in points if p[0] == longest]
    return (longest, max(rates) if loaded else min(rates))


def _ratio(rows: Rows, a: str, b: str, metric: str, loaded: bool) -> tuple[float | None, str]:
    point = headline_point(rows, a, b, loaded)
    if point is None:
        return None, f"no sweep point where both {a} and {b} completed without failures"
    idx = _index(rows)
    ma, mb = idx[(a, *point)], idx[(b, *point)]
    if mb[metric] <= 0:
        return None, f"{b} {metric} is 0 at input {point[0]}, rate {point[1]:g}"
    value = ma[metric] / mb[metric]
    why = (
        f"{a} {metric} {ma[metric]:.1f} / {b} {mb[metric]:.1f} at input {point[0]} tokens, "
        f"{point[1]:g} req/s"
    )
    return value, why


def summarize(out_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """summary.json contents and, per key, how it was obtained (or why it is null)."""
    notes: dict[str, str] = {}
    summary: dict[str, Any] = {}
    scen = _load(out_dir / "scenarios.json")
    rows: Rows = scen["rows"] if scen else []
    errors: dict[str, str] = scen.get("errors", {}) if scen else {}
    pairs = {
        "ttft_push_over_pull_loaded": ("ours", "pull", "mean_ttft_ms", True),
        "tpot_push_over_pull_loaded": ("ours", "pull", "mean_tpot_ms", True),
        "ttft_ours_over_vllm_push_loaded": ("ours", "vllm-push", "mean_ttft_ms", True),
        "ttft_push_over_aggregated_light": ("ours", "aggregated", "mean_ttft_ms", False),
        # extra keys: our push with NIXL's busy-polling progress thread on, as the vLLM
        # connectors run it (the same handicap as pull), to separate mode from spinner
        "ttft_push_spin_over_pull_loaded": ("ours-spin", "pull", "mean_ttft_ms", True),
        "ttft_push_spin_over_push_loaded": ("ours-spin", "ours", "mean_ttft_ms", True),
    }
    for key, (a, b, metric, loaded) in pairs.items():
        if not rows:
            summary[key], notes[key] = None, "no scenario sweep results (scenarios.json missing)"
            continue
        value, why = _ratio(rows, a, b, metric, loaded)
        if value is None:
            failing = {s: errors[s] for s in (a, b) if s in errors}
            if failing:
                why += "; stack errors: " + "; ".join(f"{s}: {e[:300]}" for s, e in failing.items())
        summary[key], notes[key] = value, why

    overhead = _load(out_dir / "overhead.json")
    derived = (overhead or {}).get("derived", {})
    for key, router, field in (
        ("router_added_ms_p50", "ours", "added_e2el_ms_p50"),
        ("router_added_ms_p99", "ours", "added_e2el_ms_p99"),
        ("vllm_router_added_ms_p50", "vllm-router", "added_e2el_ms_p50"),
        ("vllm_router_added_ms_p99", "vllm-router", "added_e2el_ms_p99"),
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
    ):
        sat = saturation.get(router)
        summary[key] = sat["ratio_to_direct"] if sat else None
        notes[key] = (
            f"closed-loop sustained req/s through {router} / direct, same run"
            if sat
            else f"no saturation results for {router}"
        )

    transfer = _load(out_dir / "transfer.json")
    ratio = (transfer or {}).get("connector_over_bare_throughput")
    summary["connector_over_bare_nixl_throughput"] = ratio
    notes["connector_over_bare_nixl_throughput"] = (
        "median-transfer throughput, connector path (PushProducer -> PushConsumer) / "
        "bare NIXL WRITE + notification, same bytes and descriptors"
        if ratio is not None
        else "no transfer results (transfer.json missing or one kind failed)"
    )
    routing = _load(out_dir / "routing.json") or {}
    for key, value in routing_summary(routing).items():
        summary[key] = value
        notes[key] = (
            f"disagg-bench routing, part {SUMMARY_KEYS[key]} (routing.json)"
            if value is not None
            else "no routing results for this part (routing.json)"
        )
    summary["measured_at"] = time.strftime("%Y-%m-%d", time.gmtime())
    summary["machine"] = machine()
    return summary, notes


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, json.JSONDecodeError):
        return None


def markdown_table(rows: Rows, stacks: list[str]) -> str:
    """One row per (input length, rate); per stack: mean TTFT, p99 TTFT, mean TPOT (ms)."""
    idx = _index(rows)
    points = sorted({(r["input_len"], r["rate"]) for r in rows})
    head = (
        "| input | rate | "
        + " | ".join(f"{s} TTFT mean / p99 | {s} TPOT mean" for s in stacks)
        + " |"
    )
    sep = "|---|---|" + "---|---|" * len(stacks)
    lines = [head, sep]
    for input_len, rate in points:
        cells = []
        for s in stacks:
            m = idx.get((s, input_len, rate))
            if m is None:
                cells += ["-", "-"]
                continue
            fail = f" ({m['failed']} failed)" if m["failed"] else ""
            cells.append(f"{m['mean_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f}{fail}")
            cells.append(f"{m['mean_tpot_ms']:.1f}")
        lines.append(f"| {input_len} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Rows, stacks: list[str], metric: str, label: str, path: Path) -> None:
    """One panel per input length, ``metric`` against request rate, one line per stack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["input_len"] for r in rows})
    if not lens:
        return
    fig, axes = plt.subplots(1, len(lens), figsize=(5 * len(lens), 4), squeeze=False)
    for ax, input_len in zip(axes[0], lens, strict=True):
        for s in stacks:
            pts = sorted(
                (r["rate"], r["metrics"][metric])
                for r in rows
                if r["stack"] == s and r["input_len"] == input_len and r["metrics"]["completed"]
            )
            if pts:
                color = f"C{stacks.index(s)}"  # one colour per stack across panels
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.plot(xs, ys, marker="o", label=s, color=color)
        ax.set_title(f"input {input_len} tokens")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(out_dir: Path, command: str) -> dict[str, Any]:
    """Write ``results.md``, the plots and ``summary.json`` into ``out_dir``; return the summary."""
    scen = _load(out_dir / "scenarios.json") or {"rows": [], "stacks": [], "errors": {}}
    rows: Rows = scen["rows"]
    stacks = [s for s in scen.get("stacks", []) if any(r["stack"] == s for r in rows)]
    if rows:
        plot(rows, stacks, "mean_ttft_ms", "mean TTFT (ms)", out_dir / "ttft_vs_rate.png")
        plot(rows, stacks, "mean_tpot_ms", "mean TPOT (ms)", out_dir / "tpot_vs_rate.png")
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
        "| key | value | how / why null |",
        "|---|---|---|",
    ]
    for key, value in summary.items():
        if key in ("measured_at", "machine"):
            continue
        shown = "null" if value is None else f"{value:.3f}"
        parts.append(f"| `{key}` | {shown} | {notes.get(key, '')} |")
    if rows:
        parts += ["", "## Sweep (ms)", "", markdown_table(rows, stacks)]
        parts += ["", "![TTFT](ttft_vs_rate.png)", "", "![TPOT](tpot_vs_rate.png)"]
    overhead = _load(out_dir / "overhead.json")
    if overhead:
        from bench.overhead import format_report

        parts += ["", "## Router overhead (zero-delay fakes; `overhead.json`)", ""]
        parts.append(format_report(overhead["derived"]))
        if "loadavg_before_after" in overhead:
            parts += ["", f"Load average before / after: {overhead['loadavg_before_after']}"]
    transfer = _load(out_dir / "transfer.json")
    if transfer and transfer.get("rounds"):
        parts += ["", "## Transfer (`transfer.json`)", ""]
        parts.append(
            f"{transfer['bytes_per_write']} bytes in {transfer['descriptors_per_write']} "
            "descriptors per WRITE; per round: median ms per transfer (GB/s)."
        )
        parts += ["", "| round | kind | median ms | GB/s |", "|---|---|---|---|"]
        for r in transfer["rounds"]:
            ms = r.get("median_write_ms", r.get("median_latency_ms", 0.0))
            parts.append(
                f"| {r['round']} | {r['kind']} | {ms:.3f} | {r['median_throughput_gbps']:.3f} |"
            )
    if scen.get("errors"):
        parts += ["", "## Stack errors", ""]
        parts += [f"- `{s}`: {e[:500]}" for s, e in scen["errors"].items()]
    if scen.get("timings"):
        parts += ["", "## Timings (s)", ""]
        parts += [f"- {k}: {v:.0f}" for k, v in scen["timings"].items()]
    (out_dir / "results.md").write_text("\n".join(parts) + "\n")
    return summary
