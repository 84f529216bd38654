"""Scenario runner: the same sweep against every stack on real vLLM CPU instances, in one go.

Who calls it: ``disagg-bench scenarios`` (wrap it in ``flock /tmp/vllm-e2e.lock``). Stacks:

- ``ours``: our router (push) + our connector, 1P1D;
- ``ours-spin``: the same with NIXL's progress thread on (``nixl_progress_thread: true``), the
  busy-polling thread vLLM's connectors always run: separates "push vs pull" from "spinning
  thread vs none" on a machine with few cores;
- ``vllm-push``: our router (push) + vLLM's ``NixlPushConnector``, 1P1D;
- ``pull``: our router (pull) + vLLM's ``NixlConnector``, 1P1D;
- ``vllm-router``: ``vllm-router --vllm-pd-disaggregation`` in front of the pull instances;
- ``aggregated``: one vLLM instance, no router, no connector.

Instances come from :func:`devstack.stack.start_stack` (P on core 0, D on core 1, the
aggregated instance on core 0). One instance group runs at a time; a group that fails to start
is recorded with its error and the sweep goes on with the next. Every point writes its JSON.
Load points are fractions of each stack's measured capacity (:class:`SweepSpec`). Each point
has a wall-clock cap (``point_time_limit_s``): unfinished requests are cancelled and count as
failures (in the TTFT statistics at the cap: ``*_ttft_counted_ms``); a point where no request
completed ends that stack's sweep (recorded as its error) so one stalled stack cannot eat the
whole budget.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.breakdown import histogram_means, scrape
from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.results import counted_ttft_to_dict, metrics_to_dict, write_json
from bench.routers import leg_timeouts, our_router, vllm_router
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessStartError
from devstack.stack import DECODE_CORE, PREFILL_CORE
from devstack.vllm_server import read_metrics_text


@dataclass(frozen=True)
class InstanceGroup:
    """vLLM instances started together, and the stacks (routers) measured over them."""

    kind: str  # connector kind for devstack (ours, vllm-push, vllm-pull)
    topology: str  # 1p1d or aggregated
    serves: tuple[str, ...]
    connector_extra_config: tuple[tuple[str, Any], ...] = ()


# Run in this order: the headline ratios need ours, pull and aggregated first.
GROUPS: dict[str, InstanceGroup] = {
    "ours": InstanceGroup("ours", "1p1d", ("ours",)),
    "vllm-pull": InstanceGroup("vllm-pull", "1p1d", ("pull", "vllm-router")),
    "aggregated": InstanceGroup("vllm-push", "aggregated", ("aggregated",)),
    "ours-spin": InstanceGroup("ours", "1p1d", ("ours-spin",), (("nixl_progress_thread", True),)),
    "vllm-push": InstanceGroup("vllm-push", "1p1d", ("vllm-push",)),
}
STACKS: tuple[str, ...] = ("ours", "vllm-push", "pull", "vllm-router", "aggregated", "ours-spin")


@dataclass(frozen=True)
class SweepSpec:
    """The sweep each stack gets: per input length, its capacity, then load at fractions of it.

    For each input length the stack's sustainable request rate (its *capacity*) is measured
    first: ``capacity_requests`` requests in a closed loop at ``capacity_concurrency``, completed
    requests / duration. Each point then offers Poisson load at ``fraction x capacity``, the same
    fractions for every stack. The ``light`` and ``loaded`` fractions name the headline points and
    run ``repetitions`` times (each repetition with its own prompts) so their ratios carry a
    spread. Every point starts the same way whether it runs alone or inside a sweep: the
    instances idle, then ``num_warmups`` unmeasured requests at the point's input length.
    """

    input_lens: tuple[int, ...] = (512, 2048, 8192)
    fractions: tuple[float, ...] = (0.3, 0.6, 0.9, 1.2)
    light_fraction: float = 0.3
    loaded_fraction: float = 0.9
    repetitions: int = 2
    output_len: int = 64
    prefix_len: int = 0
    seconds_per_point: float = 20.0
    min_requests: int = 4
    max_requests: int = 12
    capacity_concurrency: int = 4
    capacity_requests: int = 8
    num_warmups: int = 1
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 120.0
    point_time_limit_s: float = 120.0
    idle_timeout_s: float = 60.0
    #: Confine each vLLM instance's whole process to its core (P and the aggregated instance:
    #: core 0, D: core 1) and the routers and the load generator to core 1, instead of pinning
    #: only the instances' OpenMP compute threads: each instance then has exactly one core.
    pin_processes: bool = False
    #: ``(stack, input_len, req/s)``: the capacity the points of that stack and input length are
    #: fractions of, instead of the one measured in this run (which is still measured and
    #: recorded): another run's, so both offer the same load (``disagg-bench
    #: emulator-accuracy``).
    given_capacity_rps: tuple[tuple[str, int, float], ...] = ()
    #: Mixed into every prompt's seed (not the arrivals'): a second pass over instances that
    #: are still running gets prompts of its own, so it finds nothing of the first pass's in
    #: their prefix caches, and the same arrivals (``disagg-bench emulator-accuracy``).
    prompt_salt: str = ""

    def __post_init__(self) -> None:
        if not self.input_lens or not self.fractions:
            raise ValueError("a sweep needs at least one input length and one fraction")
        if any(f <= 0 for f in self.fractions):
            raise ValueError(f"fractions must be positive, got {self.fractions}")
        if self.repetitions < 1 or self.capacity_requests < 1 or self.capacity_concurrency < 1:
            raise ValueError("repetitions, capacity requests and concurrency must be >= 1")

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, min(self.max_requests, round(rate * self.seconds_per_point)))

    def repetitions_of(self, fraction: float) -> int:
        """How often the point at ``fraction`` runs: the headline fractions repeat."""
        named = (self.light_fraction, self.loaded_fraction)
        return self.repetitions if fraction in named else 1


def point_name(stack: str, input_len: int, fraction: float, rep: int = 0) -> str:
    return f"{stack}_in{input_len}_f{fraction:g}_rep{rep}"


def _stack_seed(base: int, stack: str, input_len: int, what: str) -> int:
    # Distinct prompts per stack, point and repetition: no prefix-cache hit across points or
    # across stacks that share instances.
    return base + zlib.crc32(f"{stack}/{input_len}/{what}".encode())


class StackStalled(RuntimeError):
    """A point of the sweep (or a capacity measurement) completed no request in its time limit."""


@dataclass(frozen=True)
class _Sweep:
    """One stack's sweep in progress: where it sends, writes and records."""

    stack: str
    target: Target
    spec: SweepSpec
    out_dir: Path
    vocab_size: int
    capacities: list[dict[str, Any]]

    def prompts(self, n: int, input_len: int, what: str) -> list[BenchRequest]:
        return sweep_prompts(self.spec, self.stack, input_len, n, what, self.vocab_size)


def sweep_prompts(
    spec: SweepSpec, stack: str, input_len: int, n: int, what: str, vocab_size: int
) -> list[BenchRequest]:
    """The ``n`` prompts a sweep of ``spec`` sends ``stack`` at ``input_len`` for ``what`` (a
    point, its warm-up, the capacity run): the same arguments always give the same prompts;
    another stack, point or :attr:`SweepSpec.prompt_salt` gives others."""
    seed = _stack_seed(spec.seed, stack, input_len, spec.prompt_salt + what)
    synthetic = SyntheticSpec(
        n, input_len, spec.output_len, spec.prefix_len, vocab_size=vocab_size, seed=seed
    )
    return make_token_prompts(synthetic)


async def sweep_target(
    stack: str,
    target: Target,
    spec: SweepSpec,
    out_dir: Path,
    vocab_size: int,
    rows: list[dict[str, Any]],
    capacities: list[dict[str, Any]],
) -> None:
    """Run the whole sweep against one target; write one JSON per point; append summary rows
    (and one capacity record per input length to ``capacities``).

    Raises :class:`StackStalled` after a capacity run or point that completed nothing (what ran
    so far stays in ``rows``), ``RuntimeError`` when a warm-up fails.
    """
    sweep = _Sweep(stack, target, spec, out_dir, vocab_size, capacities)
    async with make_client(request_timeout_s=spec.request_timeout_s) as client:
        for input_len in spec.input_lens:
            capacity = await _measure_capacity(client, sweep, input_len)
            for fraction in spec.fractions:
                for rep in range(spec.repetitions_of(fraction)):
                    row = await _run_point(client, sweep, input_len, fraction, rep, capacity)
                    rows.append(row)
                    if row["metrics"]["completed"] == 0:
                        raise StackStalled(
                            f"{point_name(stack, input_len, fraction, rep)} completed no "
                            f"request ({row['errors'][:1]}); later points of this stack skipped"
                        )


async def _prepare(
    client: httpx.AsyncClient, sweep: _Sweep, input_len: int, what: str
) -> tuple[float, dict[str, float]]:
    """Wait until the instances are idle, then send the warm-ups; returns the idle wait in s and
    the warm-ups' mean TTFT and TPOT (``ttft_ms``, ``tpot_ms``; empty without warm-ups): each
    request alone on idle instances, how fast the machine runs just before the point."""
    waited = await wait_idle(client, instance_metrics(sweep.target), sweep.spec.idle_timeout_s)
    spec = sweep.spec
    if not spec.num_warmups:
        return waited, {}
    warm = sweep.prompts(spec.num_warmups, input_len, f"warm/{what}")
    limit = spec.point_time_limit_s
    load = LoadSpec(max_concurrency=1, show_progress=False, time_limit_s=limit)
    result = await run_load(client, sweep.target, warm, load)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise RuntimeError(f"warm-up failed, stack skipped: {failed[0][:500]}")
    return waited, {"ttft_ms": result.metrics.ttft.mean_ms, "tpot_ms": result.metrics.tpot.mean_ms}


async def _measure_capacity(client: httpx.AsyncClient, sweep: _Sweep, input_len: int) -> float:
    """The stack's sustainable request rate at ``input_len``: a closed loop's completed req/s."""
    spec = sweep.spec
    await _prepare(client, sweep, input_len, "capacity")
    print(f"scenarios: {sweep.stack} capacity at {input_len} tokens", file=sys.stderr)
    requests = sweep.prompts(spec.capacity_requests, input_len, "capacity")
    load = LoadSpec(
        max_concurrency=spec.capacity_concurrency,
        show_progress=False,
        time_limit_s=spec.point_time_limit_s,
    )
    result = await run_load(client, sweep.target, requests, load)
    m = result.metrics
    sweep.capacities.append(
        {
            "stack": sweep.stack,
            "input_len": input_len,
            "request_throughput": m.request_throughput,
            "completed": m.completed,
            "failed": m.failed,
            "concurrency": spec.capacity_concurrency,
        }
    )
    if m.completed == 0:
        errors = [r.error for r in result.records if not r.success][:1]
        raise StackStalled(
            f"{sweep.stack} capacity at {input_len} tokens: no request completed ({errors})"
        )
    given = [c for s, n, c in spec.given_capacity_rps if (s, n) == (sweep.stack, input_len)]
    return given[0] if given else m.request_throughput


async def _run_point(
    client: httpx.AsyncClient,
    sweep: _Sweep,
    input_len: int,
    fraction: float,
    rep: int,
    capacity: float,
) -> dict[str, Any]:
    """One point: Poisson load at ``fraction x capacity``; writes ``runs/<point>.json``."""
    spec, target = sweep.spec, sweep.target
    name = point_name(sweep.stack, input_len, fraction, rep)
    idle_wait_s, alone = await _prepare(client, sweep, input_len, f"f{fraction:g}/{rep}")
    rate = fraction * capacity
    n = spec.num_requests(rate)
    requests = sweep.prompts(n, input_len, f"f{fraction:g}/{rep}")
    print(f"scenarios: {name} ({n} requests at {rate:.3g} req/s)", file=sys.stderr)
    seed = _stack_seed(spec.seed, sweep.stack, input_len, f"arrivals/{fraction:g}/{rep}")
    load = LoadSpec(
        request_rate=rate,
        burstiness=spec.burstiness,
        seed=seed,
        show_progress=True,
        time_limit_s=spec.point_time_limit_s,
    )
    started = time.time()
    before = await scrape(client, dict(target.metrics))
    result = await run_load(client, target, requests, load)
    after = await scrape(client, dict(target.metrics))
    metrics = metrics_to_dict(result.metrics)
    metrics.update(counted_ttft_to_dict(result.records, spec.point_time_limit_s))
    row = {
        "stack": sweep.stack,
        "input_len": input_len,
        "fraction": fraction,
        "rep": rep,
        "capacity_rps": capacity,
        "rate": rate,
        "num_requests": n,
        "idle_wait_s": idle_wait_s,
        "alone": alone,
        "metrics": metrics,
        "errors": [r.error for r in result.records if not r.success][:5],
        "ttft_breakdown_ms": histogram_means(before, after),
    }
    records = [
        {
            "ttft": r.ttft,
            "latency": r.latency,
            "output_tokens": r.output_tokens,
            "start": r.start_time,
            "success": r.success,
        }
        for r in result.records
    ]
    write_json(
        sweep.out_dir / "runs" / f"{name}.json",
        {**row, "started_at": started, "sweep": asdict(spec), "records": records},
    )
    return row


def instance_metrics(target: Target) -> list[str]:
    """The ``/metrics`` URLs of the target's vLLM instances (not the router's)."""
    return [url for name, url in target.metrics if name != "router"]


async def wait_idle(client: httpx.AsyncClient, urls: list[str], timeout_s: float) -> float:
    """Poll each instance's running + waiting request gauges until all are 0, at most
    ``timeout_s``; returns the seconds waited (``timeout_s`` when they never got there: the
    point then starts anyway and its row records the wait). An unreachable ``/metrics`` counts
    as idle (the point's own requests will fail and say why)."""
    started = time.monotonic()
    while True:
        busy = 0.0
        for url in urls:
            try:
                resp = await client.get(url, timeout=5.0)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                values = read_metrics_text(resp.text)
                busy += values.get("vllm:num_requests_running", 0.0)
                busy += values.get("vllm:num_requests_waiting", 0.0)
        waited = time.monotonic() - started
        if busy == 0.0 or waited >= timeout_s:
            return min(waited, timeout_s)
        await asyncio.sleep(_IDLE_POLL_S)


_IDLE_POLL_S = 0.2


def targets_for_group(
    group: str,
    stack_obj: Any,
    wanted: tuple[str, ...],
    logs: Path,
    es: ExitStack,
    cpus: str | None,
    pids: dict[str, int] | None = None,
) -> dict[str, Target]:
    """Start the routers of ``group`` (on ``cpus`` when given) over the running instances;
    return the targets (and, into ``pids`` when given, each router's pid by stack)."""
    model = str(stack_obj.model_name)
    targets: dict[str, Target] = {}
    if group == "aggregated":
        url = stack_obj.aggregated[0].url
        targets["aggregated"] = Target(url, model, metrics=(("aggregated", f"{url}/metrics"),))
        return targets
    p_url, d_url = stack_obj.prefill[0].url, stack_obj.decode[0].url
    instances = (("prefill", f"{p_url}/metrics"), ("decode", f"{d_url}/metrics"))
    for stack in GROUPS[group].serves:
        if stack not in wanted:
            continue
        port = free_port()
        proc: ChildProcess
        metrics: tuple[tuple[str, str], ...] = instances
        if stack == "vllm-router":
            proc = vllm_router(p_url, d_url, port, logs, ready_timeout_s=120.0, cpus=cpus)
        else:
            config = stack_obj.router_config(with_identity=False)
            config["timeouts"] = leg_timeouts(300.0, total=600.0)
            proc = our_router(config, port, logs, ready_timeout_s=180.0, cpus=cpus)
            metrics = (("router", f"http://127.0.0.1:{port}/metrics"), *instances)
        es.enter_context(proc)
        if pids is not None and proc.pid is not None:
            pids[stack] = proc.pid
        targets[stack] = Target(f"http://127.0.0.1:{port}", model, metrics=metrics)
    return targets


def run_scenarios(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    out_dir: Path,
    work_dir: Path,
    start_stack: Callable[[InstanceGroup, Path], Any] | None = None,
    on_progress: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Run every wanted stack (grouped by shared instances); returns rows and per-stack errors.

    ``on_progress`` gets the results so far after each group (to save partial results). With
    ``spec.pin_processes`` this process (the load generator) runs on core 1 until it returns.
    """
    if start_stack is None:
        start_stack = partial(start_devstack, pin_processes=spec.pin_processes)
    with load_generator_pinned(spec):
        return _run_groups(spec, stacks, out_dir, work_dir, start_stack, on_progress)


def load_generator_pinned(spec: SweepSpec) -> AbstractContextManager[None]:
    """With ``spec.pin_processes``: this process (the load generator) on core 1 until the block
    ends, its CPUs restored after; else nothing. Who calls it: whatever runs sweeps
    (:func:`run_scenarios`, :mod:`bench.emulator_accuracy`), once around all of them."""
    return _this_process_on(DECODE_CORE) if spec.pin_processes else nullcontext()


def router_cpus(spec: SweepSpec) -> str | None:
    """Where the sweep's routers run: core 1 (the load generator's) when processes are pinned."""
    return str(DECODE_CORE) if spec.pin_processes else None


@contextmanager
def _this_process_on(core: int) -> Iterator[None]:
    """Run this process (the load generator) on ``core`` only, restoring its CPUs after."""
    before = os.sched_getaffinity(0)
    if not {PREFILL_CORE, DECODE_CORE} <= before:
        raise ValueError(f"pin_processes needs cores {PREFILL_CORE} and {DECODE_CORE}")
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def wanted_groups(stacks: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """The instance groups that serve any of ``stacks``, in :data:`GROUPS`' order, each with
    the wanted stacks it serves."""
    found = [(group, tuple(s for s in g.serves if s in stacks)) for group, g in GROUPS.items()]
    return [(group, wanted) for group, wanted in found if wanted]


@contextmanager
def group_targets(
    group: str,
    wanted: tuple[str, ...],
    start_stack: Callable[[InstanceGroup, Path], Any],
    logs: Path,
    spec: SweepSpec,
) -> Iterator[dict[str, Target]]:
    """``group``'s instances (``start_stack``) and the routers of the ``wanted`` stacks over
    them, by stack; all stopped when the block ends, also on an error. Raises what starting
    raises (``OSError``, ``RuntimeError``, :class:`ProcessStartError`)."""
    logs.mkdir(parents=True, exist_ok=True)
    kind, topology = GROUPS[group].kind, GROUPS[group].topology
    print(f"scenarios: starting {group} ({kind}, {topology})", file=sys.stderr)
    with ExitStack() as es:
        stack_obj = start_stack(GROUPS[group], logs)
        es.callback(stack_obj.stop)
        yield targets_for_group(group, stack_obj, wanted, logs, es, router_cpus(spec))


def stack_error(exc: BaseException) -> str:
    """How a stack's run records why it stopped: the exception's type and message, cut to
    2,000 characters (a vLLM log tail can be long)."""
    return f"{type(exc).__name__}: {exc}"[:2000]


def sweep_one(
    name: str,
    target: Target,
    spec: SweepSpec,
    out_dir: Path,
    rows: list[dict[str, Any]],
    capacities: list[dict[str, Any]],
) -> str | None:
    """:func:`sweep_target` on one target to its end; returns why it stopped early (None when
    it did not): what ran so far stays in ``rows`` and ``capacities``."""
    try:
        asyncio.run(sweep_target(name, target, spec, out_dir, 4096, rows, capacities))
    except (OSError, RuntimeError, ValueError) as exc:
        return stack_error(exc)
    return None


def _run_groups(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    out_dir: Path,
    work_dir: Path,
    start_stack: Callable[[InstanceGroup, Path], Any],
    on_progress: Callable[[dict[str, Any]], object] | None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    capacities: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    for group, wanted in wanted_groups(stacks):
        t0 = time.monotonic()
        try:
            with group_targets(group, wanted, start_stack, work_dir / group, spec) as targets:
                timings[f"{group}_startup_s"] = time.monotonic() - t0
                for name, target in targets.items():
                    t1 = time.monotonic()
                    error = sweep_one(name, target, spec, out_dir, rows, capacities)
                    if error is not None:
                        errors[name] = error
                    timings[f"{name}_sweep_s"] = time.monotonic() - t1
        except (OSError, RuntimeError, ProcessStartError) as exc:
            for name in wanted:
                errors.setdefault(name, stack_error(exc))
        timings[f"{group}_total_s"] = time.monotonic() - t0
        if on_progress is not None:
            on_progress(_result(spec, stacks, rows, capacities, errors, timings))
    return _result(spec, stacks, rows, capacities, errors, timings)


def _result(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    rows: list[dict[str, Any]],
    capacities: list[dict[str, Any]],
    errors: dict[str, str],
    timings: dict[str, float],
) -> dict[str, Any]:
    return {
        "sweep": asdict(spec),
        "stacks": list(stacks),
        "rows": list(rows),
        "capacities": list(capacities),
        "errors": dict(errors),
        "timings": dict(timings),
    }


def merge_previous(data: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """Keep ``previous`` rows and errors of stacks this run did not touch (``--merge``)."""
    if not previous:
        return data
    ran = set(data["stacks"])
    kept_rows = [r for r in previous.get("rows", []) if r["stack"] not in ran]
    kept_caps = [c for c in previous.get("capacities", []) if c["stack"] not in ran]
    kept_errors = {k: v for k, v in previous.get("errors", {}).items() if k not in ran}
    stacks = [s for s in STACKS if s in ran or s in set(previous.get("stacks", []))]
    timings = {**previous.get("timings", {}), **data["timings"]}
    return {
        **data,
        "stacks": stacks,
        "rows": kept_rows + data["rows"],
        "capacities": kept_caps + data.get("capacities", []),
        "errors": {**kept_errors, **data["errors"]},
        "timings": timings,
        "previous_commands": [*previous.get("previous_commands", []), previous.get("command")],
    }


def start_devstack(group: InstanceGroup, work_dir: Path, pin_processes: bool = False) -> Any:
    """Start ``group``'s vLLM instances with :func:`devstack.stack.start_stack` (logs and the tiny
    model under ``work_dir``); the caller stops the returned stack. Also used by
    ``disagg-bench vllm-serve``."""
    from devstack.stack import StackOptions, start_stack

    options = StackOptions(
        kind=group.kind,
        topology=group.topology,  # type: ignore[arg-type]
        connector_extra_config=dict(group.connector_extra_config),
        pin_processes=pin_processes,
    )
    return start_stack(options, work_dir)
