"""Results of ``disagg-bench vllm-serve``: vLLM's result JSON per stack and rate, ratios, report.

Who calls it: :mod:`bench.vllm_serve` (after each client run: :func:`trim_result`,
:func:`point_from_result`) and :mod:`bench.vllm_serve_cmd` (:func:`build_report`,
:func:`render_markdown`). Pure functions over dicts: no I/O except :func:`read_disagg_bench`,
which reads the ``disagg-bench scenarios`` files it is pointed at and never writes.

The input is the JSON ``vllm bench serve --save-result`` writes (vLLM 0.32: ``completed``,
``failed``, ``duration``, ``request_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms``... and, with ``--save-detailed``, per-request lists such as ``output_lens`` and
``errors``). Missing keys become ``None``; a ratio with a missing or zero side is ``None``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Per-request lists of a detailed result; :func:`trim_result` drops them.
PER_REQUEST_FIELDS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)
#: The statistics the report tabulates and compares.
REPORTED = tuple(f"{stat}_{m}_ms" for m in ("ttft", "tpot") for stat in ("mean", "median", "p99"))
_DISTRIBUTIONS = ("ttft", "tpot", "itl", "e2el")
_SCALARS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "max_concurrent_requests",
)
#: (report key, numerator stack, denominator stack).
COMPARISONS = (("ours_over_pull", "ours", "pull"), ("ours_over_vllm_push", "ours", "vllm-push"))
#: The ``disagg-bench scenarios`` key (docs/benchmarks/summary.json) matching a compared statistic.
DISAGG_BENCH_KEYS: dict[tuple[str, str], str] = {
    ("ours_over_pull", "mean_ttft_ms"): "ttft_push_over_pull_loaded",
    ("ours_over_pull", "mean_tpot_ms"): "tpot_push_over_pull_loaded",
    ("ours_over_vllm_push", "mean_ttft_ms"): "ttft_ours_over_vllm_push_loaded",
}
_LABELS = {"ours_over_pull": "ours / pull", "ours_over_vllm_push": "ours / vLLM push"}


def rate_key(rate: float) -> str:
    """A rate as a JSON key and file-name part: ``1``, ``2.5``."""
    return f"{rate:g}"


def trim_result(data: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's result without its per-request lists (what it writes without ``--save-detailed``),
    with local paths (``tokenizer_id`` is the tokenizer's folder) cut to their last part."""
    return {
        k: Path(v).name if isinstance(v, str) and v.startswith("/") else v
        for k, v in data.items()
        if k not in PER_REQUEST_FIELDS
    }


def point_from_result(stack: str, rate: float, data: Mapping[str, Any]) -> dict[str, Any]:
    """One report row from one client run's result: counts, throughput, every distribution
    statistic vLLM wrote (``mean_/median_/std_/pNN_`` of TTFT, TPOT, ITL, E2EL, in ms), the
    range of output lengths and the first errors (when the result is detailed)."""
    row: dict[str, Any] = {"stack": stack, "rate": rate, "num_prompts": data.get("num_prompts")}
    row.update({k: data.get(k) for k in _SCALARS})
    for key, value in data.items():
        parts = key.split("_")
        if len(parts) == 3 and parts[1] in _DISTRIBUTIONS and parts[2] == "ms":
            row[key] = value
    lens = [n for n in data.get("output_lens") or () if isinstance(n, int)]
    row["output_lens"] = {"min": min(lens), "max": max(lens)} if lens else None
    row["errors"] = [e for e in data.get("errors") or () if e][:3]
    return row


def failed_point(stack: str, rate: float, error: str) -> dict[str, Any]:
    """A row for a client run that wrote no result (it failed or ran past its time limit)."""
    return {"stack": stack, "rate": rate, "completed": 0, "failed": None, "errors": [error]}


def _index(points: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    return {(p["stack"], rate_key(float(p["rate"]))): p for p in points}


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
        return None
    return float(a) / float(b)


def ratios(points: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{comparison: {rate: {statistic: numerator / denominator}}}`` for every rate either side
    ran, over :data:`REPORTED`; a comparison whose stacks never ran at the same rate is empty."""
    index = _index(points)
    rates = sorted({r for _, r in index}, key=float)
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, num, den in COMPARISONS:
        out[name] = {}
        for rate in rates:
            a, b = index.get((num, rate)), index.get((den, rate))
            if a is None or b is None:
                continue
            out[name][rate] = {m: _ratio(a.get(m), b.get(m)) for m in REPORTED}
    return out


def read_disagg_bench(bench_dir: Path) -> dict[str, Any] | None:
    """The matching ``disagg-bench scenarios`` ratios from ``bench_dir/summary.json`` (value and
    spread per key of :data:`DISAGG_BENCH_KEYS`) and the point they were measured at (longest
    input length, output length and loaded fraction from ``scenarios.json``); ``None`` when
    there is no summary."""
    summary = _load(bench_dir / "summary.json")
    if summary is None:
        return None
    sweep = (_load(bench_dir / "scenarios.json") or {}).get("sweep", {})
    spread = summary.get("spread", {})
    keys = {
        key: {"value": summary.get(key), "spread": spread.get(key)}
        for key in DISAGG_BENCH_KEYS.values()
    }
    lens = sweep.get("input_lens") or []
    return {
        "keys": keys,
        "measured_at": summary.get("measured_at"),
        "loaded_fraction": (summary.get("load_points") or {}).get("loaded_fraction"),
        "input_len": max(lens) if lens else None,
        "output_len": sweep.get("output_len"),
    }


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_report(run: Mapping[str, Any], disagg_bench: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run (recipe, points, errors, command...) with its ratios and the matching
    ``disagg-bench`` ratios added: the content of ``results.json``."""
    return {**run, "ratios": ratios(run.get("points", [])), "disagg_bench": disagg_bench}


def _num(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _stat_label(metric: str) -> str:
    stat, name, _ = metric.split("_")
    return f"{name.upper()} {stat}"


def points_table(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per stack and rate: counts, achieved req/s, TTFT and TPOT statistics (ms)."""
    head = "| stack | rate (req/s) | completed / failed | achieved req/s | output tokens |"
    head += "".join(f" {_stat_label(m)} |" for m in REPORTED)
    lines = [head, "|" + "---|" * (5 + len(REPORTED))]
    for p in points:
        lens = p.get("output_lens")
        out = "-" if not lens else f"{lens['min']}" if lens["min"] == lens["max"] else str(lens)
        cells = [
            str(p["stack"]),
            rate_key(float(p["rate"])),
            f"{p.get('completed', '-')} / {p.get('failed', '-')}",
            _num(p.get("request_throughput"), 2),
            out,
            *(_num(p.get(m)) for m in REPORTED),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _disagg_cell(comparison: str, metric: str, disagg: Mapping[str, Any] | None) -> str:
    key = DISAGG_BENCH_KEYS.get((comparison, metric))
    if key is None or disagg is None:
        return ""
    entry = disagg["keys"].get(key) or {}
    value, spread = entry.get("value"), entry.get("spread") or {}
    if not isinstance(value, (int, float)):
        return f"- (`{key}`)"
    low, high = spread.get("low"), spread.get("high")
    rng = f", {low:.2f}-{high:.2f}" if isinstance(low, float) and isinstance(high, float) else ""
    return f"{value:.2f} (`{key}`{rng})"


def ratios_table(report: Mapping[str, Any]) -> list[str]:
    """Each comparison and statistic across the rates, beside the matching ``disagg-bench``
    ratio where one exists."""
    table = report["ratios"]
    rates = sorted({r for per in table.values() for r in per}, key=float)
    lines = [
        "| ratio | statistic |" + "".join(f" rate {r} |" for r in rates) + " disagg-bench |",
        "|---|---|" + "---|" * (len(rates) + 1),
    ]
    for name, _, _ in COMPARISONS:
        for metric in REPORTED:
            cells = [_num(table[name].get(r, {}).get(metric), 2) for r in rates]
            disagg = _disagg_cell(name, metric, report.get("disagg_bench"))
            row = [_LABELS[name], _stat_label(metric), *cells, disagg]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _recipe_line(report: Mapping[str, Any]) -> str:
    r = report["recipe"]
    return (
        f"Client: vLLM's own `vllm bench serve` (module `vllm.benchmarks.serve`, vLLM "
        f"{report.get('vllm_version', '?')}), backend `openai-chat`, random dataset "
        f"{r['input_len']} input / {r['output_len']} output tokens (`--ignore-eos`), "
        f"temperature {r['temperature']:g}, {r['num_prompts']} requests per rate, Poisson "
        f"arrivals at {', '.join(rate_key(x) for x in r['rates'])} req/s"
        + (f", at most {c} in flight." if (c := r.get("max_concurrency")) else ".")
    )


def _disagg_line(disagg: Mapping[str, Any] | None) -> str:
    if disagg is None:
        return "No `disagg-bench scenarios` summary.json to compare with."
    return (
        f"`disagg-bench` column: `summary.json` of `disagg-bench scenarios` (measured "
        f"{disagg.get('measured_at')}): {disagg.get('input_len')}-token prompts, "
        f"{disagg.get('output_len')} output tokens, each stack at {disagg.get('loaded_fraction')} "
        "of its own measured capacity, mean TTFT with failed requests counted at the limit; "
        "range over its repetitions."
    )


def _cell(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def watch_table(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per point that recorded them (:mod:`bench.serve_watch`): the router's TTFT stages (mean
    ms) and the cores each process kept busy, with its CPU ms per request; [] when none did."""
    rows = [p for p in points if p.get("processes")]
    if not rows:
        return []
    names = ("router", "prefill", "decode")
    lines = ["| stack | rate | router stages ms: accept_to_legs_sent / prefill / relay_to_client "]
    lines[0] += "| " + " | ".join(f"{n} cores (CPU ms/request); loop wait" for n in names)
    lines[0] += " |"
    lines.append("|---|---|---|" + "---|" * len(names))
    for p in rows:
        st = p.get("router_stages_ms") or {}
        stages = " / ".join(
            _cell(st.get(k), 1) for k in ("accept_to_legs_sent", "prefill", "relay_to_client")
        )
        cells = []
        for name in names:
            proc = p["processes"].get(name) or {}
            cells.append(
                f"{_cell(proc.get('cores'), 2)} ({_cell(proc.get('cpu_ms_per_request'), 1)}); "
                f"{_cell(proc.get('main_thread_wait_share'), 2)}"
            )
        head = f"| {p['stack']} | {rate_key(float(p['rate']))} | {stages} | "
        lines.append(head + " | ".join(cells) + " |")
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """``results.md``: the recipe, the command, the per-point table, the ratio table, errors."""
    machine = report.get("machine") or {}
    lines = [
        "# `vllm bench serve` against ours, pull and vLLM push",
        "",
        _recipe_line(report),
        "",
        f"Command: `{report.get('command')}`. Machine: {machine.get('cores')} cores, "
        f"{machine.get('cpu_model')}; measured {report.get('measured_at')}.",
        "",
        "## Per stack and rate (ms)",
        "",
        *points_table(report.get("points", [])),
        "",
        "## Ratios ours / other, per rate",
        "",
        *ratios_table(report),
        "",
        _disagg_line(report.get("disagg_bench")),
    ]
    watch = watch_table(report.get("points", []))
    if watch:
        lines += ["", "## The router's stages and the CPU of each process during each run", ""]
        lines += [
            "Cores: CPU seconds of the process and its children over the client's `duration`."
            " Loop wait: of the time the process's main thread (its event loop) had work, the"
            " part it spent waiting for a core (the kernel's schedstat).",
            "",
            *watch,
        ]
    errors = report.get("errors") or {}
    failed = [p for p in report.get("points", []) if p.get("errors")]
    if errors or failed:
        lines += ["", "## Errors", ""]
        lines += [f"- {stack}: {msg[:300]}" for stack, msg in errors.items()]
        lines += [
            f"- {p['stack']} at {rate_key(float(p['rate']))} req/s: {p['errors'][0][:300]}"
            for p in failed
        ]
    return "\n".join(lines) + "\n"
