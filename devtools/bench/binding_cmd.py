"""``disagg-bench bind``: flags, run, JSON + markdown + the KV-usage plot.

Who calls it: :mod:`bench.cli`. The run itself is :mod:`bench.binding`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.binding import JIT_SPIN, PULL_LOADED, BindSpec, run_bind_benchmark
from bench.results import command_with_options, run_in_work_dir

COMMAND = "flock /tmp/vllm-e2e.lock .venv/bin/disagg-bench bind --out-dir docs/benchmarks"


def add_bind_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BindSpec()
    parser.add_argument("--input-len", type=int, default=defaults.input_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--d-prompts", type=int, default=defaults.d_prompts)
    parser.add_argument("--short-len", type=int, default=defaults.short_len)
    parser.add_argument("--short-share", type=float, default=defaults.short_share)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--repetitions", type=int, default=defaults.repetitions)
    parser.add_argument("--light-fraction", type=float, default=defaults.light_fraction)
    parser.add_argument("--loaded-fraction", type=float, default=defaults.loaded_fraction)
    parser.add_argument(
        "--no-pull", dest="pull", action="store_false", help="skip the pull comparison"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="binding.json/.md/.png")
    parser.add_argument("--work-dir", type=Path, help="model, logs (default: a temp dir)")


def bind_command(args: argparse.Namespace) -> int:
    spec = BindSpec(
        input_len=args.input_len,
        output_len=args.output_len,
        d_prompts=args.d_prompts,
        short_len=args.short_len,
        short_share=args.short_share,
        requests=args.requests,
        repetitions=args.repetitions,
        light_fraction=args.light_fraction,
        loaded_fraction=args.loaded_fraction,
        pull=args.pull,
    )
    data = run_in_work_dir(
        lambda folder: run_bind_benchmark(spec, folder), args.work_dir, "disagg-bind-"
    )
    if data is None:
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "binding.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_kv_usage(data, args.out_dir / "binding_d_kv_usage.png")
    markdown = format_report(data)
    (args.out_dir / "binding.md").write_text(markdown)
    print(markdown)
    return 0


def format_report(data: dict[str, Any]) -> str:
    """binding.md: the command, the setup, one row per (load, mode), the summary keys."""
    lines = ["# Binding D late (push.bind) on real vLLM CPU", "", _setup(data), ""]
    lines += [
        "| load | bind | TTFT mean ms | TTFT p99 ms | D alone: TTFT p99 ms | TPOT mean ms "
        "| goodput req/s | D unwritten block-s | both Ds' KV full % | P wait for D p50 ms "
        "| P waited for D % | P WRITE mean ms | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, cell in data["table"].items():
        load, bind = key.split("/")
        cols = [_cell(cell, k) for k in _COLUMNS]
        lines.append(f"| {load} | {bind} | " + " | ".join(cols) + " |")
    lines += ["", "summary.json keys:", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["summary"].items()]
    lines += ["", "![D's KV usage over time per mode](binding_d_kv_usage.png)", ""]
    return "\n".join(lines)


_COLUMNS = (
    "ttft_mean_ms",
    "ttft_p99_ms",
    "alone_ttft_p99_ms",
    "tpot_mean_ms",
    "goodput_rps",
    "unwritten_block_s",
    "kv_full_pct",
    "p_wait_p50_ms",
    "p_waited_pct",
    "write_mean_ms",
    "failed",
)


def _setup(data: dict[str, Any]) -> str:
    spec, slo = data["spec"], data["slo"]
    text = (
        f"Produced by `{_command(spec)}`: 1P2D, tiny model, our connector (no busy NIXL progress "
        f"thread); P on core 0, both Ds on core 1; prompts of {spec['input_len']} token ids "
        f"through P, {_shorts(spec)}{spec['output_len']} output tokens; each D's KV cache "
        f"{spec['d_blocks']} blocks of 128 tokens ({spec['d_prompts']} pushed requests' worth). "
        "The stack's measured capacity "
        f"{data['capacity_rps']:.2f} requests/s ({spec['capacity_requests']} requests at once "
        f"through a just-in-time router); light = {spec['light_fraction']:g}x, loaded = "
        f"{spec['loaded_fraction']:g}x of it, Poisson arrivals, {spec['requests']} requests "
        f"per point, {spec['repetitions']} repetitions (mean, low-high). Goodput: completed "
        f"requests/s with TTFT <= {_ttft_slo(slo['ttft_ms'])} and TPOT <= "
        f"{slo['tpot_ms']:.1f} ms (3x the light eager median TTFT of the same prompt length, "
        "1.5x its median TPOT). TTFT mean and p99: the requests through P."
    )
    if data.get("pull_capacity_rps") is None:
        return text + " Pull was not compared (`--no-pull`)."
    return text + (
        f" `{PULL_LOADED}`: the pull comparison, every stack at the loaded fraction of the pull "
        f"stack's measured capacity ({data['pull_capacity_rps']:.2f} requests/s), the same "
        "prompts and arrivals: pull, our router in pull mode over vLLM's `NixlConnector` on "
        "another 1P2D (vLLM's NIXL connectors always run nixl's busy progress thread, one per "
        f"instance); `{JIT_SPIN}`, just in time on our connector with that thread turned on (three "
        "such threads on 2 cores slow both stacks alike); eager and just in time on our stack as "
        "shipped (no such thread)."
    )


_OPTIONS = (
    "input_len",
    "output_len",
    "d_prompts",
    "short_len",
    "short_share",
    "requests",
    "repetitions",
    "light_fraction",
    "loaded_fraction",
)
"""The :class:`BindSpec` fields :func:`add_bind_arguments` offers as ``--`` options."""


def _command(spec: dict[str, Any]) -> str:
    """:data:`COMMAND` with the options of a run that were not the defaults."""
    defaults = asdict(BindSpec())
    return command_with_options(COMMAND, spec, defaults, _OPTIONS, {"pull": "--no-pull"})


def _shorts(spec: dict[str, Any]) -> str:
    if not spec.get("short_share"):
        return ""
    lengths = {k: spec[k] for k in ("input_len", "short_len", "short_share")}
    return (
        f"{100 * spec['short_share']:.0f} % of the requests with {spec['short_len']}-token "
        f"prompts that D serves alone (`disaggregation.min_prompt_tokens` "
        f"{BindSpec(**lengths).min_prompt_tokens}), spread among the others; "
    )


def _ttft_slo(by_length: dict[str, float]) -> str:
    return ", ".join(f"{v:.0f} ms ({n}-token prompts)" for n, v in by_length.items())


def _cell(cell: dict[str, Any], key: str) -> str:
    mean, low, high = cell["mean"].get(key), cell["low"].get(key), cell["high"].get(key)
    if mean is None:
        return "-"
    return f"{mean:.2f} ({low:.2f}-{high:.2f})" if low != high else f"{mean:.2f}"


def plot_kv_usage(data: dict[str, Any], path: Path) -> None:
    """D's KV usage (both Ds' mean) over each point's run, first repetition, one panel per
    load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, load in zip(axes, ("light", "loaded"), strict=True):
        for point in data["points"]:
            if point["load"] == load and point["rep"] == 0 and point["kv_usage"]:
                t, usage = zip(*point["kv_usage"], strict=True)
                ax.plot(t, [100 * u for u in usage], label=point["bind"])
        ax.set_title(f"{load} load")
        ax.set_xlabel("seconds into the point")
        ax.legend()
    axes[0].set_ylabel("D KV cache usage, %")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
