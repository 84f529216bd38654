"""Upstream HTTP clients on the router's traffic: CPU per streamed request, same fake, same run.

Who calls it: ``disagg-bench clients``. The router's legs are streamed completions read to
``[DONE]`` over kept-alive loopback connections; this benchmark sends exactly that, closed loop
at a fixed concurrency, against one zero-delay fake vLLM (``devstack.fake_vllm``, pinned to the
first CPU while this process runs on the last), with each client in turn, interleaved over
rounds so drift hits all alike. Reported per client: this process's CPU time per request
(``time.process_time``: what a client costs the router's one core) and requests per second.

Clients: ``httpx`` (its own httpcore pool), ``httpx-aiohttp`` (httpx's API over aiohttp's
connections, ``httpx_aiohttp.AiohttpTransport``), ``aiohttp`` (aiohttp alone; its SSE lines are
split here, a stand-in for a reader the router would need) and ``h1`` (the router's own
upstream client, :class:`disagg_router.router.upstream.client.UpstreamClient`, read by the router's
:class:`disagg_router.router.upstream.sse.EventReader`: how every upstream call goes out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import httpx_aiohttp

from bench.floor_router import origin_of, post_head
from bench.overhead import MODEL, cpu_split, fake_process
from bench.results import log_folder, write_outputs
from devstack.ports import free_port
from devstack.sse_client import aiter_data
from disagg_router.router.upstream.client import ClientLimits, UpstreamClient
from disagg_router.router.upstream.sse import EventReader

KINDS = ("httpx", "httpx-aiohttp", "aiohttp", "h1")
HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class ClientsSpec:
    """Load shape: requests per round and client, concurrency, tokens per stream, rounds."""

    requests: int = 1500
    concurrency: int = 32
    output_len: int = 16
    rounds: int = 3
    kinds: tuple[str, ...] = KINDS


Send = Callable[[], Awaitable[int]]


async def _closed_loop(send: Send, spec: ClientsSpec) -> dict[str, float]:
    """``spec.requests`` sends at ``spec.concurrency``; CPU ms per request and req/s."""
    left = spec.requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await send() != spec.output_len:
                raise RuntimeError("a stream ended with the wrong number of events")

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_ms_per_request": 1000 * cpu / spec.requests, "request_rate": spec.requests / wall}


async def _round(kind: str, url: str, body: bytes, spec: ClientsSpec) -> dict[str, float]:
    timeout = httpx.Timeout(30.0)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    if kind == "aiohttp":
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def send_aiohttp() -> int:
                events = 0
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            events += 1
                return events

            await _closed_loop(send_aiohttp, ClientsSpec(requests=50, concurrency=8))
            return await _closed_loop(send_aiohttp, spec)
    if kind == "h1":
        return await _h1_round(url, body, spec)
    transport = (
        httpx_aiohttp.AiohttpTransport(limits=limits)
        if kind == "httpx-aiohttp"
        else httpx.AsyncHTTPTransport(limits=limits)
    )
    async with httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits) as client:

        async def send_httpx() -> int:
            request = client.build_request("POST", url, content=body, headers=HEADERS)
            resp = await client.send(request, stream=True)
            events = 0
            try:
                async for _ in aiter_data(resp):
                    events += 1
            finally:
                await resp.aclose()
            return events

        await _closed_loop(send_httpx, ClientsSpec(requests=50, concurrency=8))
        return await _closed_loop(send_httpx, spec)


async def _h1_round(url: str, body: bytes, spec: ClientsSpec) -> dict[str, float]:
    origin = origin_of(url)
    head = post_head(origin, httpx.URL(url).raw_path.decode(), body)
    pool = UpstreamClient(ClientLimits(30.0, 30.0, 4.0, 4096))

    async def send_h1() -> int:
        batches = 0
        async with pool.request(origin, head, body) as answer:
            async for _ in EventReader(answer.read_chunk, answer.content_type):
                batches += 1
        return batches

    try:
        await _closed_loop(send_h1, ClientsSpec(requests=50, concurrency=8))
        return await _closed_loop(send_h1, spec)
    finally:
        await pool.aclose()


def run_clients(spec: ClientsSpec, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the fake, run every client for every round; per client the median round."""
    fake_cpus, own_cpus = cpu_split(True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = json.dumps(
        {"model": MODEL, "prompt": [1] * 128, "max_tokens": spec.output_len, "stream": True}
    ).encode()
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in spec.kinds}
    with (
        log_folder(log_dir, "bench-clients-") as logs,
        fake_process("fake-vllm", port, logs, cpus=fake_cpus),
    ):
        if own_cpus is not None:
            os.sched_setaffinity(0, {int(own_cpus)})
        for _ in range(spec.rounds):
            for kind in spec.kinds:
                rounds[kind].append(asyncio.run(_round(kind, url, body, spec)))
    median = {
        kind: {
            key: statistics.median(r[key] for r in results)
            for key in ("cpu_ms_per_request", "request_rate")
        }
        for kind, results in rounds.items()
    }
    return {
        "spec": spec.__dict__,
        "cpus": [fake_cpus, own_cpus],
        "rounds": rounds,
        "median": median,
    }


def format_report(data: dict[str, Any]) -> str:
    """Markdown table: median CPU per request and rate per client, CPU relative to httpx."""
    median = data["median"]
    base = median.get("httpx", {}).get("cpu_ms_per_request")
    lines = [
        "| client | CPU ms / streamed request | vs httpx | req/s (closed loop) |",
        "|---|---|---|---|",
    ]
    for kind, m in median.items():
        ratio = f"{m['cpu_ms_per_request'] / base:.2f}x" if base else "n/a"
        lines.append(
            f"| {kind} | {m['cpu_ms_per_request']:.3f} | {ratio} | {m['request_rate']:.0f} |"
        )
    return "\n".join(lines)


def add_clients_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ClientsSpec()
    parser.add_argument("--requests", type=int, default=defaults.requests, help="per round")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    parser.add_argument("--result-file", type=Path, help="write JSON results here")
    parser.add_argument("--markdown-file", type=Path, help="write the markdown table here")


def clients_command(args: argparse.Namespace) -> int:
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: --kinds: unknown {unknown}, choose from {KINDS}", file=sys.stderr)
        return 2
    spec = ClientsSpec(args.requests, args.concurrency, args.output_len, args.rounds, kinds)
    data = run_clients(spec)
    data["loadavg_after"] = os.getloadavg()
    write_outputs(data, format_report(data), args.result_file, args.markdown_file)
    return 0
