"""Binding D late (``push.bind``) on real vLLM CPU: eager, just_in_time and adaptive routers over
one 1P2D stack of our connector, the same prompts and arrivals for each (prefix caching off, so
every point computes its prompts anew).

Who calls it: ``disagg-bench bind`` (:mod:`bench.binding_cmd`; wrap it in ``flock
/tmp/vllm-e2e.lock``). The stack: P on core 0, both Ds on core 1, D's KV cache cut to
``d_prompts`` requests' worth of blocks (``--num-gpu-blocks-override``) so that eager binding,
which holds D's blocks from arrival, runs it full while P's queue is long. Half the requests
(``short_share``) have short prompts that D serves alone: with one P, whose queue and D's are
both first come first served, a pushed request holding D's blocks early delays only requests
that wait on P anyway; the requests that need D's KV at once are those that do not go through
that P, here the short ones (elsewhere those of another P). The stack's capacity
is measured first (a burst through a just-in-time router: with D's cache that small, D's KV and
P's prefills limit it about equally); the light point offers ``light_fraction`` of it, the loaded
(D-KV-bound) point ``loaded_fraction``; each point records the share of its time both Ds' caches
were full, which shows whether eager binding ran them full. For each repetition and load the
modes run in turn (a fresh router each, P's speed learned from ``warmups`` requests first). Per
point: the client's TTFT and TPOT, the goodput (completed requests per second within both SLOs,
which are set from this run's light eager medians), D's unwritten block-seconds (our connector's
``disagg_push_unwritten_block_seconds_total`` on both Ds), P's wait for D's registration
(``disagg_push_wait_for_registration_seconds``), how the router bound D, its prediction error,
and D's KV usage sampled over time (for the plot). The pull comparison (:func:`_pull_and_spin`)
runs first, on two more 1P2D stacks, both with NIXL's busy progress thread (vLLM's NIXL
connector always runs one, nixl 1.5.1's, per instance): pull over vLLM's ``NixlConnector``, and
just in time on our connector with the thread turned on; then, on our stack as shipped (no
such thread), eager and just in time at the same rate: :data:`PULL_LOADED` points.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.metrics import RequestRecord, rounded_ratio
from bench.routers import leg_timeouts, our_router
from bench.scrapes import by_label, delta, histogram, scrape
from devstack.ports import free_port
from devstack.stack import Stack, StackOptions, start_stack

BINDS = ("eager", "just_in_time", "adaptive")
PULL = "pull"
JIT_SPIN = "just_in_time-spin"
"""Just in time on our connector with NIXL's busy progress thread on (the pull comparison)."""
AS_SHIPPED = ("eager", "just_in_time")
"""The modes run on our stack as shipped at the pull comparison's rate."""
PULL_LOADED = "pull_loaded"
"""The load of the pull comparison's points: ``loaded_fraction`` of the pull stack's capacity."""
FULL_USAGE = 0.9
"""D's KV cache counts as full at this usage (both Ds' mean): a D holding one long request is
at 97 %."""
BLOCK_SIZE = 128
"""vLLM CPU's default KV block size, in tokens."""
_SAMPLE_S = 0.25


@dataclass(frozen=True)
class BindSpec:
    """What ``disagg-bench bind`` runs."""

    input_len: int = 8000
    output_len: int = 32
    d_prompts: int = 1
    """D's KV cache holds this many whole requests (prompt and output)."""
    short_len: int = 256
    """Prompt tokens of the requests D serves alone (below the router's
    ``disaggregation.min_prompt_tokens``, :attr:`min_prompt_tokens`)."""
    short_share: float = 0.5
    """The share of the requests that are short: they need D's KV at once, where a pushed
    request bound at arrival holds it through P's queue (0: every request goes through P)."""
    requests: int = 40
    capacity_requests: int = 16
    """Requests sent at once through a just-in-time router to measure the stack's capacity."""
    light_fraction: float = 0.3
    loaded_fraction: float = 1.0
    """The D-KV-bound point: the stack's measured capacity, where P's queue rarely empties and
    eager binding holds both Ds' caches full most of the time (each point's ``kv_full_pct``)."""
    repetitions: int = 2
    warmups: int = 3
    ttft_slo_factor: float = 3.0
    """TTFT SLO: this times the light eager median TTFT of the run."""
    tpot_slo_factor: float = 1.5
    """TPOT SLO: this times the light eager median TPOT of the run."""
    point_time_limit_s: float = 300.0
    seed: int = 0
    pull: bool = True
    """Also compare with pull at the loaded point (two more stacks: :func:`_pull_and_spin`)."""

    @property
    def min_prompt_tokens(self) -> int:
        """The router's ``disaggregation.min_prompt_tokens``: halfway between the two lengths."""
        return (self.input_len + self.short_len) // 2 if self.short_share > 0 else 0

    @property
    def d_blocks(self) -> int:
        """Each D's KV cache in blocks: ``d_prompts`` requests (at least one max-length request:
        vLLM refuses to start with less) and vLLM's null block."""
        per_request = math.ceil((self.input_len + self.output_len) / BLOCK_SIZE) + 1
        return max(self.d_prompts, 1) * per_request + 1


@dataclass
class Point:
    """One mode at one load, one repetition."""

    bind: str
    load: str
    rep: int
    rate: float
    completed: int
    failed: int
    duration_s: float
    ttft_ms: list[float]
    tpot_ms: list[float]
    prompt_lens: list[int]
    """Of each completed request, in the order of ``ttft_ms``."""
    unwritten_block_s: float
    p_wait: dict[str, float]
    write: dict[str, float]
    """P's WRITEs (post to completion): the part of D's unwritten time no binding saves."""
    binds: dict[str, float]
    prediction_error: dict[str, float]
    kv_usage: list[tuple[float, float]]

    def goodput(self, ttft_slo_ms: dict[int, float], tpot_slo_ms: float) -> float:
        """Completed requests per second within both SLOs (TTFT's per prompt length)."""
        both = zip(self.ttft_ms, self.tpot_ms, self.prompt_lens, strict=True)
        good = sum(
            1
            for ttft, tpot, n in both
            if ttft <= ttft_slo_ms.get(n, math.inf) and tpot <= tpot_slo_ms
        )
        return good / self.duration_s if self.duration_s > 0 else 0.0

    def kv_full_pct(self) -> float:
        """The share of the point's KV samples (in %) at which both Ds' caches were full (their
        mean usage at least :data:`FULL_USAGE`)."""
        full = sum(1 for _, usage in self.kv_usage if usage >= FULL_USAGE)
        return 100 * full / len(self.kv_usage) if self.kv_usage else 0.0

    def ttft_of(self, short: bool, min_prompt_tokens: int) -> list[float]:
        """TTFTs of the requests D served alone (``short``) or of the pushed ones."""
        return [
            t
            for t, n in zip(self.ttft_ms, self.prompt_lens, strict=True)
            if (n < min_prompt_tokens) == short
        ]


def run_bind_benchmark(spec: BindSpec, work_dir: Path) -> dict[str, Any]:
    """(``spec.pull``) the pull comparison's two stacks, then every point on our 1P2D stack; the
    result (see :func:`summarize`)."""
    pull_capacity, points = _pull_and_spin(spec, work_dir) if spec.pull else (None, [])
    with _started(spec, work_dir, "ours") as stack:
        capacity, mine = asyncio.run(_run(spec, stack, work_dir, pull_capacity))
    return summarize(spec, capacity, points + mine, pull_capacity)


@contextmanager
def _started(spec: BindSpec, work_dir: Path, kind: str, spin: bool = False) -> Iterator[Stack]:
    """A 1P2D stack of connector ``kind`` (``spin``: our connector with NIXL's busy progress
    thread, as vLLM's connectors always run it), D's KV cut to ``spec.d_blocks``, warmed up."""
    per_d = ["--num-gpu-blocks-override", str(spec.d_blocks)] if spec.d_prompts else []
    options = StackOptions(
        kind=kind,
        topology="1p2d",
        enforce_eager=True,
        max_model_len=spec.input_len + spec.output_len + BLOCK_SIZE,  # vLLM: D holds one at most
        extra_args=("--no-enable-prefix-caching",),  # every point prefills its prompts anew
        instance_args={"d0": per_d, "d1": per_d},
        connector_extra_config={"nixl_progress_thread": True} if spin else {},
    )
    stack = start_stack(options, work_dir)
    try:
        stack.warm_up()  # vLLM CPU: a D whose first forward pass reads transferred KV dies
        yield stack
    finally:
        stack.stop()


def _prompts(spec: BindSpec) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The warm-up prompts and the measured ones (:func:`prompt_mix` of ``spec``'s)."""
    return prompt_mix(
        spec.requests,
        spec.warmups,
        (spec.input_len, spec.short_len),
        spec.short_share,
        spec.output_len,
        spec.seed,
    )


def prompt_mix(
    requests: int,
    warmups: int,
    lengths: tuple[int, int],
    short_share: float,
    output_len: int,
    seed: int,
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """``warmups`` long prompts (P's speed is learned from them) and ``requests`` measured ones
    of token ids, ``short_share`` of them short, spread evenly among the long: ``lengths`` is
    (long, short), the same prompts for the same arguments."""
    long_len, short_len = lengths
    shorts = round(requests * short_share) if short_len else 0
    longs = make_token_prompts(
        SyntheticSpec(requests - shorts + warmups, long_len, output_len, seed=seed)
    )
    short = make_token_prompts(SyntheticSpec(max(shorts, 1), short_len, output_len, seed=seed + 1))[
        :shorts
    ]
    warm, long_iter, short_iter = longs[:warmups], iter(longs[warmups:]), iter(short)
    measured = [
        next(short_iter) if (i + 1) * shorts // requests > i * shorts // requests
        else next(long_iter)
        for i in range(requests)
    ]  # fmt: skip
    return warm, measured


async def _run(
    spec: BindSpec, stack: Stack, work_dir: Path, pull_capacity: float | None
) -> tuple[float, list[Point]]:
    """On our stack as shipped: eager and just in time at the pull comparison's rate (when
    ``pull_capacity`` is known), then the stack's capacity and the light and loaded points."""
    points: list[Point] = []
    async with make_client() as client:
        run = _Points(client, stack, spec, work_dir, points)
        if pull_capacity is not None:
            rate = pull_capacity * spec.loaded_fraction
            await run.at(PULL_LOADED, rate, lambda rep: modes_in_turn(rep, AS_SHIPPED))
        capacity = await _capacity(client, stack, "just_in_time", spec, work_dir)
        await run.at("light", capacity * spec.light_fraction, modes_in_turn)
        await run.at("loaded", capacity * spec.loaded_fraction, modes_in_turn)
    return capacity, points


def modes_in_turn(rep: int, modes: tuple[str, ...] = BINDS) -> tuple[str, ...]:
    """The order ``modes`` run in at repetition ``rep``: reversed every other repetition, so
    that a drift in the machine's speed during a repetition (up to 2x within minutes here)
    favours no mode over two repetitions."""
    return modes if rep % 2 == 0 else modes[::-1]


@dataclass(frozen=True)
class _Points:
    """Runs points on one stack and collects them (and prints a line for each)."""

    client: httpx.AsyncClient
    stack: Stack
    spec: BindSpec
    work_dir: Path
    out: list[Point]

    async def at(self, load: str, rate: float, modes: Callable[[int], tuple[str, ...]]) -> None:
        """Every repetition of ``load`` at ``rate`` requests/s, ``modes(rep)`` in turn, a fresh
        router each."""
        warm, measured = _prompts(self.spec)
        for rep in range(self.spec.repetitions):
            for bind in modes(rep):
                with _router(self.stack, bind, self.spec, self.work_dir) as url:
                    point = await _point(
                        self.client, self.stack, url, self.spec, (bind, load, rep), warm,
                        measured, rate,
                    )  # fmt: skip
                self.out.append(point)
                print(_line(point), flush=True)


def _pull_and_spin(spec: BindSpec, work_dir: Path) -> tuple[float, list[Point]]:
    """Pull (our router, vLLM's ``NixlConnector``) against just in time on our connector with
    the same busy progress thread (vLLM's connectors cannot run without it; on 2 cores, three
    such threads take most of a core, so both stacks pay it): the pull stack's capacity, then
    both at ``loaded_fraction`` of it, the same prompts and arrivals (:data:`PULL_LOADED`)."""
    with _started(spec, work_dir, "vllm-pull") as stack:
        capacity, pull = asyncio.run(_pull_loaded(spec, stack, work_dir, PULL, None))
    with _started(spec, work_dir, "ours", spin=True) as stack:
        _, jit = asyncio.run(_pull_loaded(spec, stack, work_dir, JIT_SPIN, capacity))
    return capacity, pull + jit


async def _pull_loaded(
    spec: BindSpec, stack: Stack, work_dir: Path, bind: str, capacity: float | None
) -> tuple[float, list[Point]]:
    """``bind`` (``pull`` or ``just_in_time`` on a spinning stack) at the loaded fraction of
    ``capacity`` (None: this stack's, measured first), each repetition."""
    points: list[Point] = []
    async with make_client() as client:
        if capacity is None:
            capacity = await _capacity(client, stack, bind, spec, work_dir)
        run = _Points(client, stack, spec, work_dir, points)
        await run.at(PULL_LOADED, capacity * spec.loaded_fraction, lambda _rep: (bind,))
    return capacity, points


async def _capacity(
    client: httpx.AsyncClient, stack: Stack, bind: str, spec: BindSpec, work_dir: Path
) -> float:
    """The stack's requests per second: ``capacity_requests`` whole requests sent at once
    through a ``bind`` router (P's speed learned from the warm-ups first), completed over the
    time the last one took. Everything the points share counts: P's prefills, the WRITEs, D's
    decodes within its KV cache, and the router and client on the same two cores."""
    warm, measured = _prompts(spec)
    with _router(stack, bind, spec, work_dir) as url:
        target = Target(url, stack.model_name)
        await run_load(client, target, warm, LoadSpec(max_concurrency=1, show_progress=False))
        burst = measured[: spec.capacity_requests]
        result = await run_load(client, target, burst, LoadSpec(show_progress=False))
    done = sum(1 for r in result.records if r.success)
    capacity = done / result.metrics.duration_s if result.metrics.duration_s > 0 else 0.0
    print(f"{bind} stack capacity {capacity:.2f} requests/s", flush=True)
    return capacity


@contextmanager
def _router(stack: Stack, bind: str, spec: BindSpec, work_dir: Path) -> Iterator[str]:
    """Our router over ``stack``: push with ``push.bind`` = ``bind``, or pull mode (``pull``);
    D chosen by load (``power_of_two``: with two Ds, the less loaded; what binding late
    chooses with is the load at the moment it binds); short prompts to D alone."""
    config = stack.router_config(
        with_identity=bind != PULL, health_interval_s=30.0, decode_policy="power_of_two"
    )
    if bind == PULL:
        config["mode"] = "pull"
    else:
        config["push"] = {"bind": bind.removesuffix("-spin")}
    config["load_signals"] = {"interval": 0.5, "stale_after": 2.0}
    config["disaggregation"] = {"min_prompt_tokens": spec.min_prompt_tokens}
    config["timeouts"] = leg_timeouts(300.0, total=600.0)
    port = free_port()
    logs = work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # On the pull comparison's stacks three busy progress threads share 2 cores and the
    # instances answer slowly: one run's router was not ready within 60 s.
    with our_router(config, port, logs, ready_timeout_s=180.0):
        yield f"http://127.0.0.1:{port}"


async def _point(
    client: httpx.AsyncClient,
    stack: Stack,
    url: str,
    spec: BindSpec,
    what: tuple[str, str, int],
    warm: list[BenchRequest],
    measured: list[BenchRequest],
    rate: float,
) -> Point:
    target = Target(url, stack.model_name)
    learn = LoadSpec(max_concurrency=1, show_progress=False)
    await run_load(client, target, warm, learn)  # one at a time: P's speed learned
    urls = {"router": url, **{i.name: i.url for i in stack.instances}}
    before = await scrape(client, urls)
    samples: list[tuple[float, float]] = []
    sampler = asyncio.create_task(_sample_kv(client, stack, samples))
    load = LoadSpec(
        request_rate=rate,
        seed=spec.seed,
        show_progress=False,
        time_limit_s=spec.point_time_limit_s,
    )
    try:
        result = await run_load(client, target, measured, load)
    finally:
        sampler.cancel()
    after = await scrape(client, urls)
    ok = [r for r in result.records if r.success]
    decodes = [i.name for i in stack.decode]
    return Point(
        bind=what[0],
        load=what[1],
        rep=what[2],
        rate=rate,
        completed=len(ok),
        failed=len(result.records) - len(ok),
        duration_s=result.metrics.duration_s,
        ttft_ms=[1000 * r.ttft for r in ok],
        tpot_ms=[_tpot_ms(r) for r in ok],
        prompt_lens=[r.prompt_len for r in ok],
        unwritten_block_s=sum(
            delta(before, after, d, "disagg_push_unwritten_block_seconds_total") for d in decodes
        ),
        p_wait=histogram(before, after, "p0", "disagg_push_wait_for_registration_seconds"),
        write=histogram(before, after, "p0", "disagg_push_write_seconds"),
        binds=by_label(before, after, "router", "disagg_router_decode_binds_total", "reason"),
        prediction_error=by_label(
            before, after, "router", "disagg_router_prefill_finish_error_seconds_sum", "direction"
        ),
        kv_usage=samples,
    )


def _tpot_ms(record: RequestRecord) -> float:
    """:meth:`RequestRecord.tpot` in ms; 0 for an answer of one token."""
    return 1000 * (record.tpot() or 0.0)


async def _sample_kv(
    client: httpx.AsyncClient, stack: Stack, out: list[tuple[float, float]]
) -> None:
    """D's KV usage (both Ds' mean, 0..1) every :data:`_SAMPLE_S` until cancelled."""
    start = time.perf_counter()
    while True:
        usage = []
        for d in stack.decode:
            text = (await client.get(f"{d.url}/metrics", timeout=10.0)).text
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:kv_cache_usage_perc":
                    usage.append(sum(s.value for s in family.samples))
        out.append((time.perf_counter() - start, sum(usage) / max(len(usage), 1)))
        await asyncio.sleep(_SAMPLE_S)


def _line(p: Point) -> str:
    ttft = statistics.mean(p.ttft_ms) if p.ttft_ms else 0.0
    return (
        f"{p.load:6s} rep {p.rep} {p.bind:12s} rate {p.rate:.2f}/s done {p.completed} "
        f"failed {p.failed} ttft mean {ttft:.0f} ms unwritten {p.unwritten_block_s:.1f} "
        f"block-s P wait p50 {p.p_wait.get('p50_ms', 0):.1f} ms binds {p.binds}"
    )


def summarize(
    spec: BindSpec, capacity: float, points: list[Point], pull_capacity: float | None = None
) -> dict[str, Any]:
    """The result: spec, capacities, SLOs, every point, per (load, bind) figures and the
    summary.json keys (:data:`bench.report.BIND_KEYS`)."""
    light_eager = [p for p in points if p.load == "light" and p.bind == "eager"]
    ttft_slo = _ttft_slo(light_eager, spec.ttft_slo_factor)
    tpot_slo = spec.tpot_slo_factor * _median(light_eager, "tpot_ms")
    table: dict[str, dict[str, Any]] = {}
    for load in ("light", "loaded", PULL_LOADED):
        for bind in (*BINDS, PULL, JIT_SPIN):
            mine = [p for p in points if p.load == load and p.bind == bind]
            if mine or (bind in BINDS and load != PULL_LOADED):
                table[f"{load}/{bind}"] = _figures(mine, (ttft_slo, tpot_slo), spec)
    return {
        "spec": asdict(spec) | {"d_blocks": spec.d_blocks},
        "capacity_rps": capacity,
        "pull_capacity_rps": pull_capacity,
        "slo": {"ttft_ms": {str(n): v for n, v in ttft_slo.items()}, "tpot_ms": tpot_slo},
        "table": table,
        "summary": _keys(table),
        "points": [asdict(p) for p in points],
    }


def _median(points: list[Point], field: str) -> float:
    values = [v for p in points for v in getattr(p, field)]
    return statistics.median(values) if values else 0.0


def _ttft_slo(points: list[Point], factor: float) -> dict[int, float]:
    """Per prompt length: ``factor`` times the median TTFT of ``points``' requests of it."""
    by_length: dict[int, list[float]] = {}
    for p in points:
        for ttft, n in zip(p.ttft_ms, p.prompt_lens, strict=True):
            by_length.setdefault(n, []).append(ttft)
    return {n: factor * statistics.median(v) for n, v in sorted(by_length.items())}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _figures(
    points: list[Point], slo: tuple[dict[int, float], float], spec: BindSpec
) -> dict[str, Any]:
    """Per repetition and their mean: the pushed requests' TTFT mean/p99, the TTFT p99 of those
    D served alone, TPOT mean, goodput, unwritten block-s, P's wait p50, the share of P's
    prefills that waited for D's registration at all, P's WRITE mean."""

    def each(p: Point) -> dict[str, float]:
        pushed = p.ttft_of(False, spec.min_prompt_tokens)
        return {
            "ttft_mean_ms": statistics.mean(pushed) if pushed else 0.0,
            "ttft_p99_ms": _p99(pushed),
            "alone_ttft_p99_ms": _p99(p.ttft_of(True, spec.min_prompt_tokens)),
            "tpot_mean_ms": statistics.mean(p.tpot_ms) if p.tpot_ms else 0.0,
            "goodput_rps": p.goodput(*slo),
            "unwritten_block_s": p.unwritten_block_s,
            "p_wait_p50_ms": p.p_wait.get("p50_ms", 0.0),
            "p_waited_pct": 100 * p.p_wait.get("nonzero", 0.0),
            "write_mean_ms": p.write.get("mean_ms", 0.0),
            "kv_full_pct": p.kv_full_pct(),
            "failed": float(p.failed),
        }

    reps = [each(p) for p in points]
    keys = reps[0].keys() if reps else ()
    mean = {k: statistics.mean(r[k] for r in reps) for k in keys}
    return {"mean": mean, "low": _fold(reps, min), "high": _fold(reps, max), "reps": reps}


def _fold(reps: list[dict[str, float]], how: Any) -> dict[str, float]:
    return {k: how(r[k] for r in reps) for k in (reps[0] if reps else {})}


def _keys(table: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def m(cell: str, key: str) -> float:
        return float(table[cell]["mean"].get(key, 0.0)) if table[cell]["mean"] else 0.0

    better = max(m("loaded/eager", "goodput_rps"), m("loaded/just_in_time", "goodput_rps"))
    return {
        "d_idle_block_seconds_jit_over_eager": rounded_ratio(
            m("loaded/just_in_time", "unwritten_block_s"), m("loaded/eager", "unwritten_block_s")
        ),
        "goodput_jit_over_eager_d_kv_bound": rounded_ratio(
            m("loaded/just_in_time", "goodput_rps"), m("loaded/eager", "goodput_rps")
        ),
        "ttft_jit_over_eager_light": rounded_ratio(
            m("light/just_in_time", "ttft_mean_ms"), m("light/eager", "ttft_mean_ms")
        ),
        "p_wait_for_d_p50_ms": round(m("loaded/just_in_time", "p_wait_p50_ms"), 3),
        "goodput_adaptive_over_better_d_kv_bound": rounded_ratio(
            m("loaded/adaptive", "goodput_rps"), better
        ),
        "ttft_jit_over_pull_loaded": _pull_ratio(table, "just_in_time", m),
        "ttft_jit_spin_over_pull_loaded": _pull_ratio(table, JIT_SPIN, m),
    }


def _pull_ratio(
    table: dict[str, dict[str, Any]], bind: str, m: Callable[[str, str], float]
) -> float | None:
    """``bind``'s mean TTFT of the pushed requests over pull's at :data:`PULL_LOADED`; None
    without a pull comparison."""
    ours, pull = f"{PULL_LOADED}/{bind}", f"{PULL_LOADED}/{PULL}"
    if ours not in table or pull not in table:
        return None
    return rounded_ratio(m(ours, "ttft_mean_ms"), m(pull, "ttft_mean_ms"))
