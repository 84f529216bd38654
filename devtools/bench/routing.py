"""``disagg-bench routing``: what the routing policies buy, each against its baseline, same run.

The parts (each selectable):

- ``uneven`` (fake vLLM instances in this process, no inference; D waits for its P's KV as in
  push mode): two prefill fakes whose prefill is compute bound (one slot each, so requests queue,
  reported as waiting in ``/metrics``), one twice as slow as the other, behind our router;
  ``power_of_two`` vs ``round_robin`` for P at the same Poisson load: p99 TTFT. Key:
  ``p99_ttft_p2c_over_round_robin_uneven``.
- ``prefix`` (real vLLM CPU, 2P1D with our connector, vLLM prefix caching on): conversations,
  each a long system prompt of its own plus growing user turns, Poisson arrivals, turns of a
  round in shuffled order; each instance's KV cache holds about ``cache_tokens`` (more than the
  conversations routed to one P by affinity, less than all of them); ``prefix_affinity`` vs
  ``round_robin`` for P, each on fresh prompts:
  mean and p99 TTFT and P's prefix-cache hit rate (vLLM's ``prefix_cache_hits/queries``). Key:
  ``ttft_prefix_affinity_over_round_robin`` (mean TTFT).
- ``kv`` (real vLLM CPU, :mod:`bench.routing_kv`): growing chats and groups sharing long system
  prompts on 2P1D stacks with KV events; ``round_robin``, ``prefix_affinity`` and ``kv_aware``
  behind our router (push), ``vllm-router``'s ``kv_aware`` and ``cache_aware`` (pull), each
  ``kv_repetitions`` times on the same prompts and arrivals. Keys:
  ``ttft_kv_aware_over_round_robin``, ``ttft_kv_aware_over_vllm_router_kv_aware``,
  ``p_hit_rate_kv_aware_over_vllm_router_kv_aware``, ``router_cpu_kv_aware_over_round_robin``.
- ``workers`` (fakes, as ``uneven``): ``least_in_flight`` for P with ``serve --workers``
  ``workers`` (2) vs one worker at the same load; in-flight counts are per worker, so each
  worker sees part of the legs. Key: ``p99_ttft_least_in_flight_workers_over_one``. Then
  (:mod:`bench.workers_throughput`, zero-delay fakes) the closed-loop throughput of
  ``workers`` workers vs one, ``workers_rounds`` alternating rounds. Key:
  ``throughput_workers_over_one``.
- ``light`` (real vLLM CPU, same stack plus one aggregated instance on one core): short prompts
  at a light rate; our router with conditional disaggregation (every prompt under the threshold,
  so D serves alone on its one core) vs the aggregated instance directly. Key:
  ``ttft_conditional_over_aggregated_light`` (mean TTFT).

Who calls it: :mod:`bench.routing_cmd`. Results: ``routing.json`` (every number), a short
``routing.md`` and the keys merged into ``summary.json``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.routers import leg_timeouts, our_router
from bench.routing_kv import (
    DEFAULT_STACKS,
    STACKS,
    KvBenchPlan,
    KvWorkload,
    p_cache_counters,
    run_kv,
)
from bench.workers_throughput import ThroughputSpec, run_workers_throughput
from devstack.fake_vllm import (
    FakeBehavior,
    FakeVllmServer,
    FakeVllmState,
    KvFabric,
    PushIdentity,
)
from devstack.ports import free_port

FAKE_MODEL = "fake-model"
PARTS = ("uneven", "prefix", "light", "kv", "workers")


@dataclass(frozen=True)
class RoutingBenchSpec:
    """Every knob of the parts (defaults: a few minutes in all on a 2-core machine)."""

    parts: tuple[str, ...] = PARTS
    uneven_prefill_s: float = 0.1  # the fast P's prefill; the slow one takes twice as long
    uneven_rate: float = 8.0
    uneven_requests: int = 240
    workers: int = 2  # the workers part: serve --workers this many vs one
    workers_rounds: int = 3  # its closed-loop throughput: alternating rounds per router
    workers_requests: int = 1000  # requests per round and router (concurrency 32)
    conversations: int = 6
    turns: int = 3
    system_len: int = 3072
    turn_len: int = 64
    prefix_rate: float = 0.5
    #: KV cache of each instance, in tokens (0: vLLM's default, far more than the workload):
    #: below the conversations' working set on one P, above half of it, as when many
    #: conversations share a fleet whose caches cannot each hold them all
    cache_tokens: int = 16384
    block_size: int = 128  # vLLM CPU default
    light_input_len: int = 512
    light_rate: float = 0.5
    light_requests: int = 16
    output_len: int = 16
    seed: int = 0
    # ---- kv (bench.routing_kv): chats + groups sharing system prompts, 5 stacks ----
    kv_stacks: str = ",".join(DEFAULT_STACKS)
    kv_repetitions: int = 2
    kv_chats: int = 8
    kv_turns: int = 4
    kv_chat_system_len: int = 1024
    kv_turn_len: int = 128
    kv_groups: int = 4
    kv_group_size: int = 8
    kv_group_prefix_len: int = 2048
    kv_question_len: int = 64
    kv_rate: float = 0.5
    #: each instance's KV cache (tokens): under the working set, above half of it
    kv_cache_tokens: int = 16384
    kv_decode_only_fraction: float = 0.8


def _load(rate: float, seed: int, warmups: int = 1) -> LoadSpec:
    return LoadSpec(
        request_rate=rate,
        seed=seed,
        num_warmups=warmups,
        show_progress=False,
        percentiles=(50.0, 99.0),
        time_limit_s=600.0,
    )


def _run(url: str, model: str, requests: Sequence[BenchRequest], load: LoadSpec) -> dict[str, Any]:
    """One load run against ``url``; TTFT summary (ms) and completion counts."""

    async def go() -> dict[str, Any]:
        async with make_client() as client:
            result = await run_load(client, Target(url, model), requests, load)
        m = result.metrics
        return {
            "completed": m.completed,
            "failed": m.failed,
            "mean_ttft_ms": m.ttft.mean_ms,
            "p50_ttft_ms": m.ttft.percentile(50.0),
            "p99_ttft_ms": m.ttft.percentile(99.0),
        }

    return asyncio.run(go())


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    ok = a.get("completed") and b.get("completed") and not a["failed"] and not b["failed"]
    return a[key] / b[key] if ok and b[key] > 0 else None


# ---- uneven backends (fakes) -------------------------------------------------------------------


def _fake(name: str, fabric: KvFabric, prefill_s: float, slots: int | None) -> FakeVllmServer:
    """A fake P (``prefill_s`` > 0, one identity each) or D; all share ``fabric``, so D waits
    for its P's KV as vLLM does."""
    behavior = FakeBehavior(prefill_delay_s=prefill_s, prefill_slots=slots)
    identity = PushIdentity(engine_id=f"engine-{name}")
    return FakeVllmServer(FakeVllmState(FAKE_MODEL, behavior, identity, fabric=fabric))


def _uneven_config(p_urls: Sequence[str], d_url: str, policy: str) -> dict[str, Any]:
    return {
        "models": [FAKE_MODEL],
        "prefill": {"policy": policy, "instances": [{"url": u} for u in p_urls]},
        "decode": {"instances": [{"url": d_url}]},
        "load_signals": {"interval": 0.25, "stale_after": 1.0},
        "health": {"interval": 5.0},
    }


@contextmanager
def _uneven_fakes(spec: RoutingBenchSpec) -> Iterator[tuple[list[str], str]]:
    """The prefill URLs (a fast and a twice-as-slow fake) and the decode URL, while they run."""
    fabric = KvFabric()
    with ExitStack() as stack:
        fast = stack.enter_context(_fake("p-fast", fabric, spec.uneven_prefill_s, 1))
        slow = stack.enter_context(_fake("p-slow", fabric, 2 * spec.uneven_prefill_s, 1))
        decode = stack.enter_context(_fake("d", fabric, 0.0, None))
        yield [fast.url, slow.url], decode.url


def _uneven_requests(spec: RoutingBenchSpec) -> list[BenchRequest]:
    return make_token_prompts(
        SyntheticSpec(spec.uneven_requests, input_len=64, output_len=4, seed=spec.seed)
    )


def run_uneven(spec: RoutingBenchSpec, logs: Path) -> dict[str, Any]:
    """power_of_two vs round_robin over a fast and a twice-as-slow prefill fake."""
    requests = _uneven_requests(spec)
    runs: dict[str, Any] = {}
    with _uneven_fakes(spec) as (p_urls, d_url):
        for policy in ("round_robin", "power_of_two"):
            port = free_port()
            with our_router(_uneven_config(p_urls, d_url, policy), port, logs):
                load = _load(spec.uneven_rate, spec.seed)
                runs[policy] = _run(f"http://127.0.0.1:{port}", FAKE_MODEL, requests, load)
    return {
        "runs": runs,
        "p99_ttft_p2c_over_round_robin_uneven": _ratio(
            runs["power_of_two"], runs["round_robin"], "p99_ttft_ms"
        ),
    }


def run_workers(spec: RoutingBenchSpec, logs: Path) -> dict[str, Any]:
    """least_in_flight for P over the uneven fakes: ``spec.workers`` router workers vs one."""
    requests = _uneven_requests(spec)
    runs: dict[str, Any] = {}
    with _uneven_fakes(spec) as (p_urls, d_url):
        for workers in (1, spec.workers):
            port = free_port()
            config = _uneven_config(p_urls, d_url, "least_in_flight")
            with our_router(config, port, logs, workers=workers):
                load = _load(spec.uneven_rate, spec.seed)
                url = f"http://127.0.0.1:{port}"
                runs[f"workers_{workers}"] = _run(url, FAKE_MODEL, requests, load)
    if spec.workers_rounds:
        shape = ThroughputSpec(spec.workers, spec.workers_rounds, spec.workers_requests)
        throughput = run_workers_throughput(shape, logs)
    else:
        throughput = {"throughput_workers_over_one": None}
    return {
        "runs": runs,
        "p99_ttft_least_in_flight_workers_over_one": _ratio(
            runs[f"workers_{spec.workers}"], runs["workers_1"], "p99_ttft_ms"
        ),
        "throughput": throughput,
        "throughput_workers_over_one": throughput["throughput_workers_over_one"],
    }


# ---- real vLLM: shared prefixes and light load ---------------------------------------------------


def conversation_requests(spec: RoutingBenchSpec, seed: int) -> list[BenchRequest]:
    """Conversations as token-id prompts: round ``t`` holds turn ``t`` of every conversation
    (system prompt plus ``t + 1`` user turns), in a shuffled order."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(16, 4096) for _ in range(n)]

    systems = [draw(spec.system_len) for _ in range(spec.conversations)]
    turns = [[draw(spec.turn_len) for _ in range(spec.turns)] for _ in systems]
    out: list[BenchRequest] = []
    for t in range(spec.turns):
        order = list(range(spec.conversations))
        rng.shuffle(order)
        for k in order:
            ids = systems[k] + [i for turn in turns[k][: t + 1] for i in turn]
            out.append(BenchRequest(tuple(ids), len(ids), spec.output_len))
    return out


@contextmanager
def _router_for(stack: Any, logs: Path, **overrides: dict[str, Any]) -> Iterator[str]:
    config = stack.router_config()
    config["timeouts"] = leg_timeouts(120.0, health=60.0)
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values}
    port = free_port()
    with our_router(config, port, logs, ready_timeout_s=180.0):
        yield f"http://127.0.0.1:{port}"


def run_prefix(spec: RoutingBenchSpec, stack: Any, logs: Path) -> dict[str, Any]:
    """prefix_affinity vs round_robin for P on shared-prefix conversations (fresh prompts each)."""
    p_urls = [p.url for p in stack.prefill]
    runs: dict[str, Any] = {}
    for i, policy in enumerate(("round_robin", "prefix_affinity")):
        requests = conversation_requests(spec, seed=spec.seed + 100 + i)
        with _router_for(stack, logs, prefill={"policy": policy}) as url:
            hits0, queries0 = p_cache_counters(p_urls)
            run = _run(url, stack.model_name, requests, _load(spec.prefix_rate, spec.seed, 0))
            hits1, queries1 = p_cache_counters(p_urls)
        run["prefill_prefix_cache_hit_rate"] = (hits1 - hits0) / max(queries1 - queries0, 1.0)
        runs[policy] = run
    return {
        "runs": runs,
        "ttft_prefix_affinity_over_round_robin": _ratio(
            runs["prefix_affinity"], runs["round_robin"], "mean_ttft_ms"
        ),
        "p99_ttft_prefix_affinity_over_round_robin": _ratio(
            runs["prefix_affinity"], runs["round_robin"], "p99_ttft_ms"
        ),
    }


def run_light(spec: RoutingBenchSpec, stack: Any, logs: Path) -> dict[str, Any]:
    """Conditional disaggregation (D alone for short prompts) vs the aggregated instance."""
    requests = make_token_prompts(
        SyntheticSpec(
            spec.light_requests, spec.light_input_len, spec.output_len, seed=spec.seed + 7
        )
    )
    load = _load(spec.light_rate, spec.seed)
    runs = {"aggregated": _run(stack.aggregated[0].url, stack.model_name, requests, load)}
    rule = {"min_prompt_tokens": spec.light_input_len * 2}
    with _router_for(stack, logs, disaggregation=rule) as url:
        runs["conditional"] = _run(url, stack.model_name, requests, load)
    return {
        "runs": runs,
        "ttft_conditional_over_aggregated_light": _ratio(
            runs["conditional"], runs["aggregated"], "mean_ttft_ms"
        ),
    }


def run_real(spec: RoutingBenchSpec, logs: Path) -> dict[str, Any]:
    """The real-vLLM parts on one 2P1D stack with our connector plus one aggregated instance."""
    from devstack.stack import StackOptions, start_stack

    options = StackOptions(kind="ours", topology="2p1d", with_aggregated=True)
    if spec.cache_tokens:
        blocks = -(-spec.cache_tokens // spec.block_size)
        args = ("--block-size", str(spec.block_size), "--num-gpu-blocks-override", str(blocks))
        options = replace(options, extra_args=args, max_model_len=min(8192, spec.cache_tokens))
    out: dict[str, Any] = {}
    with start_stack(options, logs) as stack:
        stack.warm_up()
        if "light" in spec.parts:
            out["light"] = run_light(spec, stack, logs)
        if "prefix" in spec.parts:
            out["prefix"] = run_prefix(spec, stack, logs)
    return out


def kv_plan(spec: RoutingBenchSpec) -> KvBenchPlan:
    """The ``kv`` part's plan from the spec's ``kv_*`` knobs."""
    workload = KvWorkload(
        chats=spec.kv_chats,
        turns=spec.kv_turns,
        chat_system_len=spec.kv_chat_system_len,
        turn_len=spec.kv_turn_len,
        groups=spec.kv_groups,
        group_size=spec.kv_group_size,
        group_prefix_len=spec.kv_group_prefix_len,
        question_len=spec.kv_question_len,
        output_len=spec.output_len,
        seed=spec.seed + 300,
    )
    stacks = tuple(s for s in spec.kv_stacks.split(",") if s)
    unknown = set(stacks) - set(STACKS)
    if unknown:
        raise ValueError(f"--kv-stacks: unknown {sorted(unknown)}; choose from {STACKS}")
    return KvBenchPlan(
        workload,
        stacks,
        spec.kv_repetitions,
        spec.kv_cache_tokens,
        spec.block_size,
        spec.kv_decode_only_fraction,
    )


def run_routing(spec: RoutingBenchSpec, logs: Path) -> dict[str, Any]:
    """Run the selected parts; the result holds the spec, every run and the ratios."""
    out: dict[str, Any] = {"spec": asdict(spec)}
    if "uneven" in spec.parts:
        out["uneven"] = run_uneven(spec, logs)
    if "workers" in spec.parts:
        out["workers"] = run_workers(spec, logs)
    if {"prefix", "light"} & set(spec.parts):
        out.update(run_real(spec, logs))
    if "kv" in spec.parts:
        load = _load(spec.kv_rate, spec.seed, 0)
        out["kv"] = run_kv(
            kv_plan(spec), logs, lambda url, model, requests: _run(url, model, requests, load)
        )
    return out


SUMMARY_KEYS = {
    "ttft_prefix_affinity_over_round_robin": "prefix",
    "ttft_conditional_over_aggregated_light": "light",
    "p99_ttft_p2c_over_round_robin_uneven": "uneven",
    "ttft_kv_aware_over_round_robin": "kv",
    "ttft_kv_aware_over_vllm_router_kv_aware": "kv",
    "p_hit_rate_kv_aware_over_vllm_router_kv_aware": "kv",
    "router_cpu_kv_aware_over_round_robin": "kv",
    "p99_ttft_least_in_flight_workers_over_one": "workers",
    "throughput_workers_over_one": "workers",
}


def routing_summary(result: dict[str, Any]) -> dict[str, float | None]:
    """The summary.json keys of a routing result (None for a part that did not run)."""
    return {key: result.get(part, {}).get(key) for key, part in SUMMARY_KEYS.items()}
