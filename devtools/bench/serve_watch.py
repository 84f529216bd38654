"""What a ``disagg-bench vllm-serve`` point records beside vLLM's client: our router's TTFT stages
and the CPU time of the router and of each vLLM instance over the client run.

Who calls it: :mod:`bench.vllm_serve` (:func:`bench.vllm_serve.run_point`), around each client
run. Before the client starts it reads each watched process's CPU time (the process and its
descendants: a vLLM API server and its engine core, a router and its workers) and scrapes the
router's ``/metrics``; after the client has exited it reads both again. The CPU deltas are put
against the benchmark's own duration (vLLM's ``duration``: first request sent -> last answer),
so ``cores`` is how many of the machine's cores that process kept busy on average while the
requests ran (the client's start-up, about 20 s of imports, falls outside it: the instances
and the router are idle then). For the process's main thread (the router's event loop, a vLLM
API server's event loop) it also reads the kernel's scheduler statistics
(``/proc/<pid>/task/<pid>/schedstat``: time on a CPU, time runnable but waiting for one), so a
stage that grows because the loop waits for a core shows apart from one that grows because
the loop is busy. It never fails a point: a process that is gone reads 0 CPU, a
``/metrics`` that does not answer gives no stages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.breakdown import router_stages, scrape
from bench.loadgen import make_client
from devstack.process import tree_cpu_seconds


@dataclass(frozen=True)
class PointWatch:
    """The router's ``/metrics`` URL (``None``: no stages) and the processes to time, by name
    (``router``, ``prefill``, ``decode``) and pid."""

    metrics_url: str | None = None
    pids: tuple[tuple[str, int], ...] = ()


def main_thread_schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of ``pid``'s main thread so
    far; (0.0, 0.0) when unreadable (the process is gone, no schedstat)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def process_shares(
    cpu_s: Mapping[str, float],
    duration_s: float,
    completed: int,
    main_thread: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, dict[str, float | None]]:
    """Per process: CPU seconds, ``cores`` (CPU seconds / ``duration_s``) and CPU ms per
    completed request (``None`` when there is no duration or no completed request); with
    ``main_thread`` (per process, its main thread's (run, wait) seconds) also those and
    ``main_thread_wait_share``: wait / (run + wait), the part of the time the thread had work
    that it spent waiting for a core."""
    out: dict[str, dict[str, float | None]] = {}
    for name, used in cpu_s.items():
        row: dict[str, float | None] = {
            "cpu_s": used,
            "cores": used / duration_s if duration_s > 0 else None,
            "cpu_ms_per_request": 1000 * used / completed if completed else None,
        }
        if main_thread is not None and name in main_thread:
            run, wait = main_thread[name]
            row["main_thread_run_s"], row["main_thread_wait_s"] = run, wait
            row["main_thread_wait_share"] = wait / (run + wait) if run + wait > 0 else None
        out[name] = row
    return out


async def _stage_totals(url: str | None) -> dict[str, Any]:
    if url is None:
        return {}
    async with make_client() as client:
        return await scrape(client, {"router": url})


def watched(
    watch: PointWatch, run: Callable[[], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run()`` (the client run, returning vLLM's result JSON) and what ``watch`` saw during
    it: ``{"router_stages_ms": {...}, "processes": process_shares(...)}``. Exceptions of
    ``run`` propagate (nothing is recorded then)."""
    cpu0 = {name: tree_cpu_seconds(pid) for name, pid in watch.pids}
    sched0 = {name: main_thread_schedstat(pid) for name, pid in watch.pids}
    before = asyncio.run(_stage_totals(watch.metrics_url))
    data = run()
    after = asyncio.run(_stage_totals(watch.metrics_url))
    cpu = {name: tree_cpu_seconds(pid) - cpu0[name] for name, pid in watch.pids}
    sched = {
        name: tuple(b - a for a, b in zip(sched0[name], main_thread_schedstat(pid), strict=True))
        for name, pid in watch.pids
    }
    duration = float(data.get("duration") or 0.0)
    completed = int(data.get("completed") or 0)
    shares = process_shares(cpu, duration, completed, {k: (v[0], v[1]) for k, v in sched.items()})
    return data, {"router_stages_ms": router_stages(before, after), "processes": shares}
