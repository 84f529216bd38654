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
Each point has a wall-clock cap (``point_time_limit_s``): unfinished requests are cancelled and
count as failures; a point where no request completed ends that stack's sweep (recorded as its
error) so one stalled stack cannot eat the whole budget.
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.breakdown import histogram_means, scrape
from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.results import metrics_to_dict, write_json
from bench.routers import our_router, vllm_router
from devstack.ports import free_port
from devstack.process import ChildProcess, ProcessStartError


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
    """The sweep each stack gets: every input length at every rate."""

    input_lens: tuple[int, ...] = (512, 2048, 8192)
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    output_len: int = 64
    prefix_len: int = 0
    seconds_per_point: float = 6.0
    min_requests: int = 6
    max_requests: int = 12
    num_warmups: int = 2
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 120.0
    point_time_limit_s: float = 120.0

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, min(self.max_requests, round(rate * self.seconds_per_point)))


def point_name(stack: str, input_len: int, rate: float) -> str:
    return f"{stack}_in{input_len}_r{rate:g}"


def _stack_seed(base: int, stack: str, input_len: int, rate: float) -> int:
    # Distinct prompts per stack and point: no prefix-cache hit across stacks that share instances.
    return base + zlib.crc32(f"{stack}/{input_len}/{rate:g}".encode())


class StackStalled(RuntimeError):
    """A point of the sweep completed no request within its time limit."""


async def sweep_target(
    stack: str,
    target: Target,
    spec: SweepSpec,
    out_dir: Path,
    vocab_size: int,
    rows: list[dict[str, Any]],
) -> None:
    """Run the whole sweep against one target; write one JSON per point; append summary rows.

    Raises ``RuntimeError`` when the warm-up fails and :class:`StackStalled` after a point that
    completed nothing (the rows of the points run so far stay in ``rows``).
    """
    async with make_client(request_timeout_s=spec.request_timeout_s) as client:
        warm = make_token_prompts(
            SyntheticSpec(
                spec.num_warmups,
                spec.input_lens[0],
                spec.output_len,
                vocab_size=vocab_size,
                seed=_stack_seed(spec.seed, stack, 0, 0.0),
            )
        )
        warmed = await run_load(
            client,
            target,
            warm,
            LoadSpec(max_concurrency=1, show_progress=False, time_limit_s=spec.point_time_limit_s),
        )
        failed = [r.error for r in warmed.records if not r.success]
        if failed:
            raise RuntimeError(f"warm-up failed, stack skipped: {failed[0][:500]}")
        for input_len in spec.input_lens:
            for rate in spec.rates:
                row = await _run_point(
                    client, stack, target, spec, out_dir, vocab_size, input_len, rate
                )
                rows.append(row)
                if row["metrics"]["completed"] == 0:
                    raise StackStalled(
                        f"{point_name(stack, input_len, rate)} completed no request "
                        f"({row['errors'][:1]}); later points of this stack skipped"
                    )


async def _run_point(
    client: httpx.AsyncClient,
    stack: str,
    target: Target,
    spec: SweepSpec,
    out_dir: Path,
    vocab_size: int,
    input_len: int,
    rate: float,
) -> dict[str, Any]:
    """One (input length, rate) point: run it, write ``runs/<point>.json``, return its row."""
    n = spec.num_requests(rate)
    seed = _stack_seed(spec.seed, stack, input_len, rate)
    requests = make_token_prompts(
        SyntheticSpec(
            n, input_len, spec.output_len, spec.prefix_len, vocab_size=vocab_size, seed=seed
        )
    )
    name = point_name(stack, input_len, rate)
    print(f"scenarios: {name} ({n} requests)", file=sys.stderr)
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
    row = {
        "stack": stack,
        "input_len": input_len,
        "rate": rate,
        "num_requests": n,
        "metrics": metrics_to_dict(result.metrics),
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
        out_dir / "runs" / f"{name}.json",
        {**row, "started_at": started, "sweep": asdict(spec), "records": records},
    )
    return row


def _targets_for_group(
    group: str, stack_obj: Any, wanted: tuple[str, ...], logs: Path, es: ExitStack
) -> dict[str, Target]:
    """Start the routers of ``group`` over the running instances; return the targets."""
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
            proc = vllm_router(p_url, d_url, port, logs, ready_timeout_s=120.0)
        else:
            config = stack_obj.router_config(with_identity=False)
            config["timeouts"] = {"prefill": 300.0, "first_token": 300.0, "total": 600.0}
            proc = our_router(config, port, logs, ready_timeout_s=180.0)
            metrics = (("router", f"http://127.0.0.1:{port}/metrics"), *instances)
        es.enter_context(proc)
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

    ``on_progress`` gets the results so far after each group (to save partial results).
    """
    if start_stack is None:
        start_stack = _start_devstack
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    for group, spec_group in GROUPS.items():
        wanted = tuple(s for s in spec_group.serves if s in stacks)
        if not wanted:
            continue
        t0 = time.monotonic()
        logs = work_dir / group
        logs.mkdir(parents=True, exist_ok=True)
        print(
            f"scenarios: starting {group} ({spec_group.kind}, {spec_group.topology})",
            file=sys.stderr,
        )
        try:
            with ExitStack() as es:
                stack_obj = start_stack(spec_group, logs)
                es.callback(stack_obj.stop)
                targets = _targets_for_group(group, stack_obj, wanted, logs, es)
                timings[f"{group}_startup_s"] = time.monotonic() - t0
                for name, target in targets.items():
                    t1 = time.monotonic()
                    try:
                        asyncio.run(sweep_target(name, target, spec, out_dir, 4096, rows))
                    except (OSError, RuntimeError, ValueError) as exc:
                        errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
                    timings[f"{name}_sweep_s"] = time.monotonic() - t1
        except (OSError, RuntimeError, ProcessStartError) as exc:
            for name in wanted:
                errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:2000])
        timings[f"{group}_total_s"] = time.monotonic() - t0
        if on_progress is not None:
            on_progress(_result(spec, stacks, rows, errors, timings))
    return _result(spec, stacks, rows, errors, timings)


def _result(
    spec: SweepSpec,
    stacks: tuple[str, ...],
    rows: list[dict[str, Any]],
    errors: dict[str, str],
    timings: dict[str, float],
) -> dict[str, Any]:
    return {
        "sweep": asdict(spec),
        "stacks": list(stacks),
        "rows": list(rows),
        "errors": dict(errors),
        "timings": dict(timings),
    }


def merge_previous(data: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """Keep ``previous`` rows and errors of stacks this run did not touch (``--merge``)."""
    if not previous:
        return data
    ran = set(data["stacks"])
    kept_rows = [r for r in previous.get("rows", []) if r["stack"] not in ran]
    kept_errors = {k: v for k, v in previous.get("errors", {}).items() if k not in ran}
    stacks = [s for s in STACKS if s in ran or s in set(previous.get("stacks", []))]
    timings = {**previous.get("timings", {}), **data["timings"]}
    return {
        **data,
        "stacks": stacks,
        "rows": kept_rows + data["rows"],
        "errors": {**kept_errors, **data["errors"]},
        "timings": timings,
        "previous_commands": [*previous.get("previous_commands", []), previous.get("command")],
    }


def _start_devstack(group: InstanceGroup, work_dir: Path) -> Any:
    from devstack.stack import StackOptions, start_stack

    options = StackOptions(
        kind=group.kind,
        topology=group.topology,  # type: ignore[arg-type]
        connector_extra_config=dict(group.connector_extra_config),
    )
    return start_stack(options, work_dir)
