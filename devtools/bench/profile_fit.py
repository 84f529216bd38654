"""Fit an emulator profile to a real vLLM CPU instance: measure its step times over prompt
lengths, batch sizes and contexts, fit the profile's step model, and write the profile.

Who calls it: ``disagg-bench fit-profile`` (:mod:`bench.profile_fit_cmd`). It starts one
aggregated vLLM CPU instance of the tiny model (the scenario benchmarks' settings: one core,
compiled), then measures

- prefill: the time to first token of one request alone, per prompt length (distinct random
  token ids, so no prefix-cache hit), the median of a few;
- decode: the instance's mean inter-token latency (its ``vllm:inter_token_latency_seconds``)
  while ``b`` copies of one cached prompt of ``c`` tokens decode together (the median of a
  few).

Each measurement is a row of what the steps it spans compute (steps, tokens, sequences, context
tokens attended, prefill query-key pairs; a prompt longer than ``max_num_batched_tokens`` takes
several chunks) plus, for a time to first token, the request's fixed cost outside the steps
(the API server's work). A non-negative least squares fit, weighted to relative error, gives the
coefficients; the report lists every row's measured and fitted time. Scheduler limits and cache
size are read from the instance (its log and ``/metrics``). The machine's speed just before and
just after the measurements (:func:`devstack.burner.work_rate`, their mean) goes into the
profile as its ``work_rate``, so engines that spend their steps on a core stretch them as much
as the machine has slowed since.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.client import Target
from devstack.burner import work_rate
from devstack.emulator.profile import Profile, StepModel, Transfer, load_profile
from devstack.stack import StackOptions, start_stack
from devstack.vllm_server import read_metrics_text

VLLM_CPU_SERVER_LIMITS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
"""vLLM 0.32 CPU's defaults for an OpenAI server (``EngineArgs``), passed explicitly so the fit
and the profile agree with what the instance ran."""
RATE_CPU_S = 1.0
"""CPU seconds of :func:`devstack.burner.work_rate` before and after the measurements."""
FEATURES = ("base_s", "per_token_s", "per_seq_s", "per_context_token_s", "per_attention_pair_s")


@dataclass(frozen=True)
class FitSpec:
    prefill_lens: tuple[int, ...] = (64, 256, 1024, 2048, 4096, 8192)
    prefill_repeats: int = 5
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    decode_contexts: tuple[int, ...] = (128, 2048)
    decode_tokens: int = 64
    decode_repeats: int = 1
    vocab: int = 4000
    seed: int = 7


@dataclass(frozen=True)
class Row:
    """One measurement: what its steps computed, its fixed cost share and its seconds."""

    label: str
    steps: float
    tokens: float
    seqs: float
    context: float
    pairs: float
    request: float  # 1: a time to first token (includes the request's fixed cost)
    answer: float  # 1: a whole JSON answer (includes the cost of building and sending it)
    seconds: float

    def features(self) -> list[float]:
        return [
            self.steps,
            self.tokens,
            self.seqs,
            self.context,
            self.pairs,
            self.request,
            self.answer,
        ]


def prefill_row(length: int, chunk: int, seconds: float, answer: bool = False) -> Row:
    """A time to first token of a ``length``-token prompt alone (chunks of ``chunk``); with
    ``answer``, the time to its whole one-token JSON answer (what a P leg waits for)."""
    steps, pairs, done = 0, 0, 0
    while done < length:
        n = min(chunk, length - done)
        pairs += n * done + n * (n + 1) // 2
        done += n
        steps += 1
    label = f"{'answer' if answer else 'prefill'} {length}"
    return Row(label, steps, length, steps, 0, pairs, 1, int(answer), seconds)


def decode_row(batch: int, context: float, seconds: float) -> Row:
    """One decode step of ``batch`` sequences attending to ``context`` tokens each."""
    label = f"decode b={batch} c={context:.0f}"
    return Row(label, 1, batch, batch, batch * context, 0, 0, 0, seconds)


def nnls(rows: list[Row]) -> list[float]:
    """Non-negative weighted least squares (relative error) of the rows' seconds: drop the most
    negative coefficient until none is negative."""
    import numpy as np  # with vLLM (torch) installed; only the fit needs it

    a = np.array([r.features() for r in rows], dtype=float)
    b = np.array([r.seconds for r in rows], dtype=float)
    w = 1.0 / b
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sub = a[:, active] * w[:, None]
        solved, *_ = np.linalg.lstsq(sub, b * w, rcond=None)
        if (solved >= 0).all():
            coef[:] = 0
            coef[active] = solved
            break
        del active[int(np.argmin(solved))]
    return [float(c) for c in coef]


def predicted(row: Row, coef: list[float]) -> float:
    return sum(f * c for f, c in zip(row.features(), coef, strict=True))


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def _stream_times(
    client: httpx.AsyncClient, target: Target, body: dict[str, Any]
) -> list[float]:
    """perf_counter() at the start and at each streamed chunk that carries text."""
    times = [time.perf_counter()]
    payload = {"model": target.model, "stream": True, **body}
    async with client.stream("POST", f"{target.base_url}/v1/completions", json=payload) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


async def _answer_seconds(client: httpx.AsyncClient, target: Target, body: dict[str, Any]) -> float:
    """Seconds until the whole non-streamed answer to ``body`` is read."""
    started = time.perf_counter()
    url = f"{target.base_url}/v1/completions"
    response = await client.post(url, json={"model": target.model, **body})
    response.raise_for_status()
    return time.perf_counter() - started


async def measure(target: Target, spec: FitSpec, chunk: int) -> list[Row]:
    rng = random.Random(spec.seed)
    rows: list[Row] = []
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        for length in spec.prefill_lens:
            ttfts = []
            for _ in range(spec.prefill_repeats + 1):  # the first one warms up
                body = {"prompt": _tokens(rng, length, spec.vocab), "max_tokens": 1}
                times = await _stream_times(client, target, body)
                ttfts.append(times[1] - times[0])
            rows.append(prefill_row(length, chunk, statistics.median(ttfts[1:])))
            answers = []
            for _ in range(spec.prefill_repeats):
                body = {"prompt": _tokens(rng, length, spec.vocab), "max_tokens": 1}
                answers.append(await _answer_seconds(client, target, body))
            rows.append(prefill_row(length, chunk, statistics.median(answers), answer=True))
        for context in spec.decode_contexts:
            for batch in spec.decode_batches:
                runs = [
                    await _decode(client, target, spec, rng, batch, context)
                    for _ in range(spec.decode_repeats)
                ]
                rows.append(sorted(runs, key=lambda r: r.seconds)[len(runs) // 2])
    return rows


async def _decode(
    client: httpx.AsyncClient,
    target: Target,
    spec: FitSpec,
    rng: random.Random,
    batch: int,
    context: int,
) -> Row:
    """``batch`` copies of one cached prompt decode together (their prefill is one token each,
    so the steps measured are decode steps); the instance's own mean inter-token latency."""
    n = spec.decode_tokens
    prompt = _tokens(rng, context, spec.vocab)
    await _stream_times(client, target, {"prompt": prompt, "max_tokens": 1})  # cache it
    body = {"prompt": prompt, "max_tokens": n, "ignore_eos": True}
    before = await _itl(client, target)
    await asyncio.gather(*(_stream_times(client, target, body) for _ in range(batch)))
    after = await _itl(client, target)
    seconds = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    return decode_row(batch, context + n / 2, seconds)


async def _itl(client: httpx.AsyncClient, target: Target) -> tuple[float, float]:
    """(sum, count) of the instance's ``vllm:inter_token_latency_seconds`` histogram."""
    text = (await client.get(f"{target.base_url}/metrics")).text
    values = read_metrics_text(text)
    name = "vllm:inter_token_latency_seconds"
    return values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)


def _cache_limits(metrics: str) -> dict[str, int]:
    """Block size and block count of the instance's KV cache (its ``cache_config_info``)."""
    found: dict[str, int] = {}
    for key, label in (("block_size", "block_size"), ("num_blocks", "num_gpu_blocks")):
        match = re.search(rf'{label}="(\d+)"', metrics)
        if match:
            found[key] = int(match.group(1))
    return found


def run_fit(
    spec: FitSpec, work: Path, base: str = "cpu-tiny", pin_processes: bool = False
) -> dict[str, Any]:
    """Start the instance (``pin_processes``: its whole process on one core, as the scenario
    sweep's ``--pin-processes`` runs it), measure, fit; the new profile and the rows."""
    limits_args = [
        arg
        for key, value in VLLM_CPU_SERVER_LIMITS.items()
        for arg in (f"--{key.replace('_', '-')}", str(value))
    ]
    options = StackOptions(
        kind="aggregated",
        topology="aggregated",
        extra_args=limits_args,
        pin_processes=pin_processes,
    )
    rates = [work_rate(RATE_CPU_S)]
    with start_stack(options, work) as stack:
        server = stack.aggregated[0].server
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        limits = {**_cache_limits(metrics), **VLLM_CPU_SERVER_LIMITS}
        old = load_profile(base)
        chunk = limits["max_num_batched_tokens"]
        rows = asyncio.run(measure(Target(server.url, stack.model_name), spec, chunk))
    rates.append(work_rate(RATE_CPU_S))
    coef = nnls(rows)
    step = StepModel(**dict(zip(FEATURES, coef[:5], strict=True)))
    profile = replace(
        old,
        model=stack.model_name,
        step=step,
        request_overhead_s=coef[5],
        answer_overhead_s=coef[6],
        block_size=limits.get("block_size", old.block_size),
        num_blocks=limits.get("num_blocks", old.num_blocks),
        max_num_batched_tokens=chunk,
        max_num_seqs=limits["max_num_seqs"],
        work_rate=round(sum(rates) / len(rates)),
    )
    table = [
        {**asdict(r), "fitted_s": predicted(r, coef), "error": predicted(r, coef) / r.seconds - 1}
        for r in rows
    ]
    return {"spec": asdict(spec), "limits": limits, "profile": profile, "rows": table}


GPU_BLOCK_SIZE = 128
"""Block size of a GPU profile: what P/D recipes use (vLLM's default of 16 fragments transfers)."""
GPU_LINK_BYTES_PER_S = 50e9
"""A GPU's share of an AWS P5en instance's network (3,200 Gbit/s of EFA for 8 H200s)."""
GPU_TRANSFER_LATENCY_S = 0.001
"""Fixed cost of one KV hand-over on GPUs: assumed, not measured here."""


def fit_estimates(data: dict[str, Any], name: str, kv_cache_gb: float) -> dict[str, Any]:
    """A GPU profile fitted to an estimator's rows (:mod:`bench.aiconfigurator_rows`' output):
    its step model, vLLM's H200 server limits, a KV cache of ``kv_cache_gb``; the fit's rows."""
    chunk = int(data["max_num_batched_tokens"])
    rows = [
        replace(prefill_row(int(r["length"]), chunk, float(r["seconds"])), request=0)
        if r["kind"] == "prefill"
        else decode_row(int(r["batch"]), float(r["context"]), float(r["seconds"]))
        for r in data["rows"]
    ]
    coef = nnls(rows)
    per_token = int(data["kv_bytes_per_token"])
    profile = Profile(
        name=name,
        source="",
        model=str(data["model"]),
        block_size=GPU_BLOCK_SIZE,
        num_blocks=int(kv_cache_gb * 1e9 // (per_token * GPU_BLOCK_SIZE)),
        max_num_batched_tokens=chunk,
        max_num_seqs=1024,
        max_model_len=40960,
        step=StepModel(**dict(zip(FEATURES, coef[:5], strict=True))),
        transfer=Transfer(per_token, GPU_LINK_BYTES_PER_S, GPU_TRANSFER_LATENCY_S),
    )
    table = [
        {**asdict(r), "fitted_s": predicted(r, coef), "error": predicted(r, coef) / r.seconds - 1}
        for r in rows
    ]
    return {
        "estimates": {k: v for k, v in data.items() if k != "rows"},
        "profile": profile,
        "rows": table,
    }
