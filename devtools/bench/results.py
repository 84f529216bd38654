"""JSON results: metrics in the field names of ``vllm bench serve`` plus the run's settings."""

from __future__ import annotations

import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.loadgen import RunResult
from bench.metrics import BenchmarkMetrics, RequestRecord, counted_ttft
from devstack.process import ProcessStartError


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def metrics_to_dict(metrics: BenchmarkMetrics) -> dict[str, Any]:
    """Flatten metrics: ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``, throughputs..."""
    out: dict[str, Any] = {
        "completed": metrics.completed,
        "failed": metrics.failed,
        "duration_s": metrics.duration_s,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        dist = getattr(metrics, name)
        out[f"mean_{name}_ms"] = dist.mean_ms
        out[f"median_{name}_ms"] = dist.median_ms
        out[f"std_{name}_ms"] = dist.std_ms
        for key, value in dist.percentiles_ms.items():
            out[f"{key}_{name}_ms"] = value
    return out


def counted_ttft_to_dict(records: Sequence[RequestRecord], limit_s: float) -> dict[str, Any]:
    """``mean_ttft_counted_ms``, ``median_…``, ``p99_…`` (failed requests at ``limit_s``, see
    :func:`bench.metrics.counted_ttft`) and ``goodput`` (completed / sent)."""
    dist = counted_ttft(records, limit_s)
    done = sum(1 for r in records if r.success)
    return {
        "mean_ttft_counted_ms": dist.mean_ms,
        "median_ttft_counted_ms": dist.median_ms,
        "p99_ttft_counted_ms": dist.percentile(99.0),
        "goodput": done / len(records) if records else 0.0,
    }


def result_to_dict(
    result: RunResult, settings: dict[str, Any], include_records: bool = False
) -> dict[str, Any]:
    """One run as a JSON-ready dict: ``settings``, ``metrics``, first errors, optional records."""
    settings = {k: (_finite(v) if isinstance(v, float) else v) for k, v in settings.items()}
    errors = [r.error for r in result.records if not r.success][:10]
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": settings,
        "metrics": metrics_to_dict(result.metrics),
        "errors": errors,
    }
    if include_records:
        out["records"] = [asdict(r) for r in result.records]
    return out


@contextmanager
def log_folder(given: Path | None, prefix: str) -> Iterator[Path]:
    """Where a benchmark's child processes log, for the ``with`` block that runs them: ``given``
    (created, kept), else a new temporary folder named ``prefix...``, removed when the block
    ends normally and kept when it raises, so a failed run's logs stay to be read. Named on
    stderr either way. Results never record it (a local path).

    Who calls it: each benchmark command that starts child processes, around all of them."""
    folder = given or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"child process logs: {folder}", file=sys.stderr)
    try:
        yield folder
    except BaseException:
        if given is None:
            print(f"child process logs kept: {folder}", file=sys.stderr)
        raise
    if given is None:
        shutil.rmtree(folder)


def run_in_work_dir(
    run: Callable[[Path], dict[str, Any]], given: Path | None, prefix: str
) -> dict[str, Any] | None:
    """``run(folder)`` in :func:`log_folder`'s folder (``given``, else a temporary one removed
    when ``run`` returns and kept when it raises); None when a stack's process failed to start
    (the error printed on stderr, the logs kept).

    Who calls it: the benchmark commands whose whole run is one call."""
    try:
        with log_folder(given, prefix) as folder:
            return run(folder)
    except ProcessStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_outputs(
    data: dict[str, Any],
    report: str,
    result_file: Path | None,
    markdown_file: Path | None,
    append: bool = False,
) -> None:
    """Print ``report``; write ``data`` as JSON and ``report`` as markdown where asked (added at
    the end of ``markdown_file`` with ``append``)."""
    print(report)
    if result_file:
        write_json(result_file, data)
    if markdown_file:
        markdown_file.parent.mkdir(parents=True, exist_ok=True)
        with markdown_file.open("a" if append else "w") as out:
            out.write(report + "\n")


def command_with_options(
    command: str,
    spec: Mapping[str, Any],
    defaults: Mapping[str, Any],
    options: Sequence[str],
    off_flags: Mapping[str, str] | None = None,
) -> str:
    """``command`` (ending in ``--out-dir DIR``) as a report names it: with ``--name value``
    before ``--out-dir`` for each of ``options`` whose value in ``spec`` is not its default,
    then ``off_flags[field]`` for each boolean field of ``spec`` that is off."""
    given = [f"--{k.replace('_', '-')} {spec[k]}" for k in options if spec[k] != defaults[k]]
    given += [flag for field, flag in (off_flags or {}).items() if not spec[field]]
    head, out_dir = command.split(" --out-dir ")
    return " ".join([head, *given, "--out-dir", out_dir])


def recorded_command(argv: Sequence[str]) -> str:
    """``disagg-bench <argv>`` as results record it: without ``--work-dir`` (where logs went,
    a path of the machine that ran it; it changes no number)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--work-dir":
            skip = True
        elif not arg.startswith("--work-dir="):
            out.append(arg)
    return "disagg-bench " + shlex.join(out)
