"""Soak: a fixed number of concurrent streams through the router for a bounded time, on fakes or
on real vLLM CPU (1P1D, our connector), watching for lost or garbled answers and for the router
process's memory and file descriptors creeping up.

Who calls it: ``disagg-bench soak``. Closed loop: ``concurrency`` workers each send streamed
requests back to back until ``duration_s`` has passed, then finish the one in flight and stop.
An answer counts as lost when it fails (HTTP error, error event, broken stream) and as garbled
when it succeeds with a token count other than the one asked for (``ignore_eos``). Every
``sample_s`` the router's RSS and open file descriptors are read from ``/proc``; the report
gives the first and last samples under load (from the end of the first interval, once every
connection is open), the maximum, and the last minus the first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.client import Target, send_request
from bench.dataset import BenchRequest
from bench.loadgen import make_client
from bench.overhead import FAKE_PREFILL_IDENTITY, MODEL, fake_process
from bench.results import log_folder
from bench.routers import our_router, router_config
from devstack.ports import free_ports
from devstack.stack import StackOptions, start_stack


@dataclass(frozen=True)
class SoakSpec:
    backend: str = "fakes"  # fakes | vllm
    concurrency: int = 50
    duration_s: float = 1800.0
    sample_s: float = 10.0
    input_len: int = 64
    output_len: int = 32


@dataclass
class SoakCounts:
    completed: int = 0
    lost: int = 0
    garbled: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def process_sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of process ``pid``, from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _prompt(i: int, length: int) -> BenchRequest:
    ids = tuple(100 + (i * 7 + j) % 500 for j in range(length))
    return BenchRequest(prompt=ids, prompt_len=length, output_len=0)


async def _worker(
    client: Any, target: Target, spec: SoakSpec, index: int, end: float, counts: SoakCounts
) -> None:
    n = 0
    while time.monotonic() < end:
        req = _prompt(index * 100003 + n, spec.input_len)
        req = BenchRequest(req.prompt, req.prompt_len, spec.output_len)
        record = await send_request(client, target, req)
        n += 1
        if not record.success:
            counts.lost += 1
            key = (record.error or "?")[:80]
            counts.errors[key] = counts.errors.get(key, 0) + 1
        elif record.output_tokens != spec.output_len:
            counts.garbled += 1
        else:
            counts.completed += 1


async def _sampler(pid: int, spec: SoakSpec, end: float, out: list[dict[str, float]]) -> None:
    start = time.monotonic()
    while True:
        rss, fds = process_sample(pid)
        out.append({"t_s": round(time.monotonic() - start, 1), "rss_kib": rss, "fds": fds})
        if time.monotonic() >= end:
            return
        await asyncio.sleep(min(spec.sample_s, max(end - time.monotonic(), 0.0)))


async def _soak(target: Target, pid: int, spec: SoakSpec) -> dict[str, Any]:
    counts = SoakCounts()
    samples: list[dict[str, float]] = []
    end = time.monotonic() + spec.duration_s
    async with make_client(max_connections=spec.concurrency * 2) as client:
        workers = [_worker(client, target, spec, i, end, counts) for i in range(spec.concurrency)]
        await asyncio.gather(_sampler(pid, spec, end, samples), *workers)
    rss, fds = process_sample(pid)  # after the load: what the idle router holds
    samples.append({"t_s": -1, "rss_kib": rss, "fds": fds})
    return {"counts": asdict(counts), "samples": samples}


def _backends(spec: SoakSpec, logs: Path, stack: ExitStack) -> tuple[dict[str, Any], str]:
    """Start the backends; (router config, served model name)."""
    if spec.backend == "fakes":
        p_port, d_port = free_ports(2)
        stack.enter_context(fake_process("fake-prefill", p_port, logs, "bench-prefill"))
        stack.enter_context(fake_process("fake-decode", d_port, logs))
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        return router_config(MODEL, p_url, d_url, identity=FAKE_PREFILL_IDENTITY), MODEL
    vllm = stack.enter_context(start_stack(StackOptions(kind="ours", topology="1p1d"), logs))
    vllm.warm_up()
    return vllm.router_config(with_identity=True), vllm.model_name


def run_soak(spec: SoakSpec, log_dir: Path | None = None) -> dict[str, Any]:
    """Start backends and the router process, soak, stop everything; the raw results."""
    with ExitStack() as stack:
        logs = stack.enter_context(log_folder(log_dir, "bench-soak-"))
        config, model = _backends(spec, logs, stack)
        (port,) = free_ports(1)
        router = stack.enter_context(our_router(config, port, logs))
        assert router.pid is not None
        raw = asyncio.run(_soak(Target(f"http://127.0.0.1:{port}", model), router.pid, spec))
    return {"spec": asdict(spec), **raw}


def _trend(samples: list[dict[str, float]], key: str, fmt: Callable[[float], str]) -> str:
    loaded = [s[key] for s in samples if s["t_s"] > 0]  # after the first interval under load
    during = loaded or [s[key] for s in samples if s["t_s"] >= 0]
    first, last, peak = during[0], during[-1], max(during)
    return f"{fmt(first)} -> {fmt(last)} (max {fmt(peak)}, last - first {fmt(last - first)})"


def _mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


def _count(value: float) -> str:
    return f"{value:g}"


def format_report(data: dict[str, Any]) -> str:
    """Markdown summary of one soak run."""
    spec, counts, samples = data["spec"], data["counts"], data["samples"]
    total = counts["completed"] + counts["lost"] + counts["garbled"]
    lines = [
        "| backend | concurrency | duration | answers | lost | garbled | router RSS | router fds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {spec['backend']} | {spec['concurrency']} | {spec['duration_s']:g} s | {total} "
        f"| {counts['lost']} | {counts['garbled']} | {_trend(samples, 'rss_kib', _mib)} "
        f"| {_trend(samples, 'fds', _count)} |",
    ]
    if counts["errors"]:
        lines.append("")
        lines += [f"- {n} x {err}" for err, n in sorted(counts["errors"].items())]
    return "\n".join(lines)
