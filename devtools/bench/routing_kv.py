"""The ``kv`` part of ``disagg-bench routing``: KV-aware routing against the other policies and
against ``vllm-router``, on real vLLM CPU.

Workload (token-id prompts, the same prompts and Poisson arrivals for every stack): (a) chats
that grow turn by turn (each its own system prompt; round ``t`` sends turn ``t`` of every chat,
shuffled) interleaved with (b) groups of requests sharing a long system prompt, each with its own
question (the shape of ``vllm bench serve --dataset-name prefix_repetition``). Every instance's
KV cache holds ``kv_cache_tokens`` (less than the working set, more than half of it) and every
instance's prefix cache is reset (``/reset_prefix_cache``) before each run.

Stacks, ``kv_repetitions`` times each: on a 2P1D push stack with our connector, our router with
``round_robin``, ``prefix_affinity`` and ``kv_aware`` for P and D (KV events; optionally
``kv_aware_decode_only``: the same with ``decode_only_fraction``); on a
2P1D pull stack of the same shape (vLLM's NixlConnector), ``vllm-router`` with ``kv_aware``
(``--pd-kv-events``) and with ``cache_aware`` for P. Per run: mean/p99 TTFT, P's prefix-cache hit
rate (hit tokens / queried tokens on the P instances), the router's CPU seconds per request; the
best achievable hit rate of the workload (one cache holding everything, block-aligned prefixes).

Who calls it: :func:`bench.routing.run_routing`. Runs start vLLM: under the shared vLLM lock.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.dataset import BenchRequest
from bench.routers import leg_timeouts, our_router, vllm_router
from devstack.ports import free_port
from devstack.process import ChildProcess, group_cpu_seconds
from devstack.vllm_server import read_metrics_text

OURS = ("round_robin", "prefix_affinity", "kv_aware", "kv_aware_decode_only")
VLLM_ROUTER = ("vllm_router_kv_aware", "vllm_router_cache_aware")
STACKS = OURS + VLLM_ROUTER
DEFAULT_STACKS = ("round_robin", "prefix_affinity", "kv_aware", *VLLM_ROUTER)
"""``kv_aware_decode_only`` (``kv_aware`` with ``decode_only_fraction``) serves follow-ups by D
alone, so P's hit rate no longer measures its routing: it is a separate, optional stack."""


@dataclass(frozen=True)
class KvWorkload:
    """The workload's shape (see the module docstring)."""

    chats: int
    turns: int
    chat_system_len: int
    turn_len: int
    groups: int
    group_size: int
    group_prefix_len: int
    question_len: int
    output_len: int
    seed: int


def kv_requests(w: KvWorkload) -> list[BenchRequest]:
    """Chats round by round, each round followed by its share of the group requests."""
    rng = random.Random(w.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(16, 4096) for _ in range(n)]

    systems = [draw(w.chat_system_len) for _ in range(w.chats)]
    turns = [[draw(w.turn_len) for _ in range(w.turns)] for _ in systems]
    prefixes = [draw(w.group_prefix_len) for _ in range(w.groups)]
    grouped = [p + draw(w.question_len) for p in prefixes for _ in range(w.group_size)]
    rng.shuffle(grouped)
    share = -(-len(grouped) // max(w.turns, 1))
    out: list[BenchRequest] = []
    for t in range(w.turns):
        order = list(range(w.chats))
        rng.shuffle(order)
        prompts = [systems[k] + [i for turn in turns[k][: t + 1] for i in turn] for k in order]
        prompts += grouped[t * share : (t + 1) * share]
        out += [BenchRequest(tuple(p), len(p), w.output_len) for p in prompts]
    return out


def best_hit_rate(requests: Sequence[BenchRequest], block_size: int) -> float:
    """Hit tokens / prompt tokens with one cache that holds every earlier prompt: per request,
    its longest block-aligned prefix shared with an earlier one (before its last token)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for request in requests:
        ids = tuple(request.prompt) if isinstance(request.prompt, tuple) else ()
        usable = (len(ids) - 1) // block_size
        blocks = 0
        while blocks < usable and ids[: (blocks + 1) * block_size] in seen:
            blocks += 1
        hits += blocks * block_size
        total += len(ids)
        seen.update(ids[: (b + 1) * block_size] for b in range(len(ids) // block_size))
    return hits / total if total else 0.0


def reset_caches(urls: Sequence[str]) -> None:
    """Empty every instance's prefix cache (vLLM with ``VLLM_SERVER_DEV_MODE=1``)."""
    for url in urls:
        httpx.post(url + "/reset_prefix_cache", timeout=60.0).raise_for_status()


def p_cache_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) summed over ``urls``."""
    hits = queries = 0.0
    for url in urls:
        values = read_metrics_text(httpx.get(url + "/metrics", timeout=10.0).text)
        hits += values.get("vllm:prefix_cache_hits_total", 0.0)
        queries += values.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """P's prefix-cache hit rate between two readings of :func:`p_cache_counters`."""
    (hits0, queries0), (hits1, queries1) = before, after
    return (hits1 - hits0) / max(queries1 - queries0, 1.0)


def measured_run(
    router: ChildProcess,
    p_urls: Sequence[str],
    run: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """``run()`` (one load) with P's hit rate and the router's CPU per request added."""
    pgid = router.pid or 0
    before = p_cache_counters(p_urls)
    cpu0 = group_cpu_seconds(pgid)
    result = run()
    cpu = group_cpu_seconds(pgid) - cpu0
    result["p_hit_rate"] = hit_rate(before, p_cache_counters(p_urls))
    result["router_cpu_ms_per_request"] = 1000 * cpu / max(result["completed"], 1)
    return result


def our_config(stack: Any, stack_name: str, decode_only_fraction: float) -> dict[str, Any]:
    """Our router's config for one of :data:`OURS` on the push stack."""
    kv = stack_name.startswith("kv_aware")
    config: dict[str, Any] = stack.router_config(
        prefill_policy="kv_aware" if kv else stack_name,
        decode_policy="kv_aware" if kv else "round_robin",
        kv_events=kv,
    )
    if stack_name == "kv_aware_decode_only":
        config["kv_events"]["decode_only_fraction"] = decode_only_fraction
    config["timeouts"] = leg_timeouts(120.0, health=60.0)
    return config


def kv_ready(url: str, timeout_s: float = 300.0) -> None:
    """Wait until the router at ``url`` has its tokenizer loaded and every KV event stream live
    (``/ready``'s ``kv_events``): before that ``kv_aware`` routes approximately."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kv = httpx.get(url + "/ready", timeout=10.0).json().get("kv_events", {})
        models = list(kv.values())
        states = {i["state"] for m in models for i in m["instances"].values()}
        if models and all(m["tokenizer"] == "loaded" for m in models) and states == {"live"}:
            return
        time.sleep(1.0)
    raise RuntimeError(f"{url}: KV-aware routing not ready after {timeout_s:g} s")


@contextmanager
def our_stack_router(
    stack: Any, name: str, logs: Path, decode_only_fraction: float
) -> Iterator[tuple[str, ChildProcess]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with our_router(our_config(stack, name, decode_only_fraction), port, logs, 180.0) as router:
        if name.startswith("kv_aware"):
            kv_ready(url)
        yield url, router


def vllm_router_args(stack: Any, name: str, block_size: int) -> list[str]:
    """``vllm-router`` policy arguments for one of :data:`VLLM_ROUTER` on the pull stack."""
    policy = name.removeprefix("vllm_router_")
    args = ["--prefill-policy", policy, "--decode-policy", "round_robin"]
    if policy == "kv_aware":
        for p in stack.prefill:
            args += ["--pd-kv-events", f"{p.url}={p.kv_endpoints['kv_events_endpoint']}"]
        args += ["--kv-event-block-size", str(block_size)]
    return args


@contextmanager
def vllm_stack_router(
    stack: Any, name: str, logs: Path, block_size: int
) -> Iterator[tuple[str, ChildProcess]]:
    port = free_port()
    router = vllm_router(
        [p.url for p in stack.prefill],
        stack.decode[0].url,
        port,
        logs,
        ready_timeout_s=180.0,
        extra_args=vllm_router_args(stack, name, block_size),
    )
    with router:
        yield f"http://127.0.0.1:{port}", router


def summarize(runs: dict[str, list[dict[str, Any]]], best: float) -> dict[str, Any]:
    """Per stack: mean over repetitions with the spread (min, max); the ratios of the summary."""
    stacks: dict[str, Any] = {}
    for name, reps in runs.items():
        ok = [r for r in reps if r.get("completed") and not r.get("failed") and "error" not in r]
        if not ok:
            stacks[name] = {"repetitions": reps}
            continue
        row: dict[str, Any] = {"repetitions": reps}
        for key in ("mean_ttft_ms", "p99_ttft_ms", "p_hit_rate", "router_cpu_ms_per_request"):
            values = [r[key] for r in ok]
            row[key] = statistics.mean(values)
            row[key + "_spread"] = [min(values), max(values)]
        stacks[name] = row

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = stacks.get(a, {}).get(key), stacks.get(b, {}).get(key)
        return x / y if x is not None and y else None

    return {
        "stacks": stacks,
        "p_hit_rate_best": best,
        "ttft_kv_aware_over_round_robin": ratio("kv_aware", "round_robin", "mean_ttft_ms"),
        "ttft_kv_aware_over_vllm_router_kv_aware": ratio(
            "kv_aware", "vllm_router_kv_aware", "mean_ttft_ms"
        ),
        "p_hit_rate_kv_aware_over_vllm_router_kv_aware": ratio(
            "kv_aware", "vllm_router_kv_aware", "p_hit_rate"
        ),
        "router_cpu_kv_aware_over_round_robin": ratio(
            "kv_aware", "round_robin", "router_cpu_ms_per_request"
        ),
    }


@dataclass(frozen=True)
class KvBenchPlan:
    """What :func:`run_kv` runs: the workload, the stacks, repetitions, cache size and the
    ``decode_only_fraction`` of the ``kv_aware`` stack."""

    workload: KvWorkload
    stacks: tuple[str, ...]
    repetitions: int
    cache_tokens: int
    block_size: int
    decode_only_fraction: float


LoadRun = Callable[[str, str, Sequence[BenchRequest]], dict[str, Any]]
"""(router URL, model, requests) -> the load's TTFT summary (``bench.routing``'s)."""


def _stack_options(kind: str, plan: KvBenchPlan) -> Any:
    from devstack.stack import StackOptions

    blocks = -(-plan.cache_tokens // plan.block_size)
    args = ("--block-size", str(plan.block_size), "--num-gpu-blocks-override", str(blocks))
    return StackOptions(
        kind=kind,
        topology="2p1d",
        kv_events=True,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        extra_args=args,
        # vLLM wants the cache to hold more than one max-length sequence
        max_model_len=min(8192, plan.cache_tokens // 2),
    )


def _runs_on(
    kind: str, names: Sequence[str], plan: KvBenchPlan, logs: Path, load_run: LoadRun
) -> dict[str, list[dict[str, Any]]]:
    """Every stack of ``names`` on one stack of ``kind``, ``repetitions`` times, caches reset
    before each run; a router that fails to start or to serve is recorded as an error."""
    from devstack.stack import start_stack

    requests = kv_requests(plan.workload)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with start_stack(_stack_options(kind, plan), logs) as stack:
        stack.warm_up()
        urls = [i.url for i in stack.instances]
        p_urls = [p.url for p in stack.prefill]
        for _ in range(plan.repetitions):
            for name in names:
                reset_caches(urls)
                routed = (
                    vllm_stack_router(stack, name, logs, plan.block_size)
                    if name in VLLM_ROUTER
                    else our_stack_router(stack, name, logs, plan.decode_only_fraction)
                )
                try:
                    with routed as (url, router):
                        run = partial(load_run, url, stack.model_name, requests)
                        result = measured_run(router, p_urls, run)
                except (RuntimeError, OSError, httpx.HTTPError) as exc:
                    lines = [line for line in str(exc).splitlines() if line.strip()]
                    last = lines[-2] if len(lines) > 1 else "".join(lines)  # the log's last error
                    result = {"error": f"{type(exc).__name__}: {last}"}
                runs[name].append(result)
    return runs


def run_kv(plan: KvBenchPlan, logs: Path, load_run: LoadRun) -> dict[str, Any]:
    """Our stacks on a push stack, vllm-router's on a pull stack; the summary of both."""
    runs: dict[str, list[dict[str, Any]]] = {}
    ours = [s for s in plan.stacks if s in OURS]
    theirs = [s for s in plan.stacks if s in VLLM_ROUTER]
    if ours:
        runs.update(_runs_on("ours", ours, plan, logs, load_run))
    if theirs:
        runs.update(_runs_on("vllm-pull", theirs, plan, logs, load_run))
    best = best_hit_rate(kv_requests(plan.workload), plan.block_size)
    return summarize(runs, best)
