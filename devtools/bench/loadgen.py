"""Drive one benchmark run: warm-ups, then requests at scheduled arrivals or max concurrency.

Who calls it: the ``bench run`` CLI, the overhead benchmark and the scenario runner. It owns no
HTTP client: the caller passes one long-lived ``httpx.AsyncClient`` (see :func:`make_client`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import httpx_aiohttp

from bench.arrivals import arrival_offsets
from bench.client import Target, send_request
from bench.dataset import BenchRequest
from bench.metrics import (
    DEFAULT_PERCENTILES,
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
)
from bench.progress import ProgressBar

T = TypeVar("T")


@dataclass(frozen=True)
class LoadSpec:
    """How requests are offered: a rate (Poisson/gamma) and/or a concurrency cap."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    show_progress: bool = True
    #: Wall-clock cap on the whole run (after warm-ups): requests not finished by then are
    #: cancelled (their streams closed) and recorded as failures; none are sent after it.
    time_limit_s: float | None = None


@dataclass(frozen=True)
class RunResult:
    """Records and metrics of one run; ``records`` excludes warm-ups."""

    records: tuple[RequestRecord, ...]
    metrics: BenchmarkMetrics


def make_client(max_connections: int = 1024, request_timeout_s: float = 600.0) -> httpx.AsyncClient:
    """The one client a run uses: explicit timeouts, enough pooled connections for the load.

    Its connections are aiohttp's (``httpx-aiohttp``): httpcore's pool costs 2.5x the CPU per
    streamed request (``disagg-bench clients``), and at the hundreds of requests per second the
    overhead benchmark offers the load generator became the bottleneck.
    """
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    transport = httpx_aiohttp.AiohttpTransport(limits=limits)
    return httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport)


async def run_load(
    client: httpx.AsyncClient,
    target: Target,
    requests: Sequence[BenchRequest],
    spec: LoadSpec,
) -> RunResult:
    """Send warm-ups (the first requests of the dataset, one at a time), then the whole dataset."""
    if spec.max_concurrency is not None and spec.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {spec.max_concurrency}")
    for i in range(spec.num_warmups):
        if requests:
            await send_request(client, target, requests[i % len(requests)])

    offsets = arrival_offsets(len(requests), spec.request_rate, spec.burstiness, spec.seed)
    semaphore = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    bar = ProgressBar(len(requests), "bench") if spec.show_progress else None

    async def one(request: BenchRequest) -> RequestRecord:
        if semaphore is None:
            record = await send_request(client, target, request)
        else:
            async with semaphore:
                record = await send_request(client, target, request)
        if bar is not None:
            bar.update()
        return record

    loop_start = time.perf_counter()
    deadline = math.inf if spec.time_limit_s is None else loop_start + spec.time_limit_s
    tasks = await launch_paced(lambda i: one(requests[i]), offsets, loop_start, deadline)
    records = await _gather_until(tasks, requests, deadline, spec.time_limit_s)
    duration = time.perf_counter() - loop_start
    if bar is not None:
        bar.close()
    metrics = compute_metrics(records, max(duration, 1e-9), spec.percentiles)
    return RunResult(records, metrics)


async def launch_paced(
    start: Callable[[int], Coroutine[Any, Any, T]],
    offsets: Sequence[float],
    loop_start: float,
    deadline: float = math.inf,
) -> list[asyncio.Task[T]]:
    """Start ``start(i)`` as a task at ``loop_start + offsets[i]`` (``time.perf_counter()``
    seconds) for each ``i`` in order, none at or past ``deadline``; the tasks started. Callers:
    :func:`run_load` and the benchmarks that send more than one request per arrival."""
    tasks: list[asyncio.Task[T]] = []
    for i, offset in enumerate(offsets):
        if loop_start + offset >= deadline:
            break
        delay = loop_start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(i)))
    return tasks


async def _gather_until(
    tasks: list[asyncio.Task[RequestRecord]],
    requests: Sequence[BenchRequest],
    deadline: float,
    time_limit_s: float | None,
) -> tuple[RequestRecord, ...]:
    """Records of all requests in order; those unfinished at ``deadline`` (or never sent) fail."""
    if tasks:
        timeout = None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    now = time.perf_counter()
    error = f"time limit of {time_limit_s or 0:g} s for the run reached"
    records: list[RequestRecord] = []
    for i, request in enumerate(requests):
        if i < len(tasks) and not tasks[i].cancelled():
            records.append(tasks[i].result())
        else:
            records.append(RequestRecord(False, request.prompt_len, 0, now, 0.0, 0.0, (), error))
    return tuple(records)
