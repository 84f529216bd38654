"""Router overhead: our router and vLLM-router (P/D mode) vs direct-to-backend, on fake instances.

Who calls it: ``disagg-bench overhead``. It starts, as separate processes, a fake prefill and
a fake decode instance (``devstack.fake_vllm``; zero delays unless ``token_delay`` spaces the
streamed tokens as a decoding instance would), our router in push mode over
them, and ``vllm-router --vllm-pd-disaggregation`` over the same fakes. With two or more CPUs
the fakes are pinned to the first and the routers to the last (``taskset``), so a router never
competes with the backends for its core. Then, in one process and interleaved per rate so drift
hits all targets alike, it offers the same Poisson streamed load to each target at fixed rates,
and finally a closed loop at a fixed concurrency to find the request rate each one sustains.
Each point also records the CPU time the target's processes used per completed request (for
``direct``: the fake decode instance), a cost that a busy shared machine does not inflate the
way it inflates latency. Everything is reported against the direct baseline of the same run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections.abc import Awaitable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx

from bench.breakdown import router_stages, scrape
from bench.client import Target
from bench.dataset import SyntheticSpec, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.results import log_folder, metrics_to_dict
from bench.routers import floor_router, our_router, pinned, router_config, vllm_router
from devstack.ports import free_ports
from devstack.process import ChildProcess, group_cpu_seconds, http_process
from disagg_router.router.observability.timeline import STAGES

MODEL = "fake-model"
PREFILL_ENGINE_ID = "bench-prefill"
# What the fake prefill reports about itself; nothing listens on that port.
FAKE_PREFILL_IDENTITY = {"engine_id": PREFILL_ENGINE_ID, "host": "127.0.0.1", "port": 5600}


@dataclass(frozen=True)
class OverheadSpec:
    """Load shape of the overhead benchmark."""

    rates: tuple[float, ...] = (100.0, 250.0, 500.0)
    seconds_per_rate: float = 6.0
    input_len: int = 128
    output_len: int = 16
    saturation_concurrency: int = 32
    saturation_requests: int = 1000
    saturation_seconds: float = 10.0
    saturation_rounds: int = 1
    """Closed loops per target, the targets taking turns round by round: the machine's speed
    drifts within minutes, so CPU per request is pooled over rounds spread across the run."""
    routers: tuple[str, ...] = ("ours", "floor", "vllm-router")
    baseline: str | None = None
    """Another checkout of the router, run beside ours as the target ``baseline`` on the same
    fakes (two commits compared within one run)."""
    seed: int = 0
    pin: bool = True
    token_delay: float = 0.0
    """Seconds the fakes wait between streamed tokens: 0 sends them back to back (the router's
    per-request cost); a decode step's time makes each token its own read and write."""
    marginal_output_len: int | None = None
    """A second output length: at each fixed rate every target also takes the same arrivals
    with this many tokens, right after its load at ``output_len``, and the report gives the CPU
    each relayed token adds (the slope between the two lengths): the cost per token without
    the cost per request, which a CPU per request divided by its tokens mixes in."""

    def __post_init__(self) -> None:
        longer = self.marginal_output_len
        if longer is not None and (longer < 1 or longer == self.output_len):
            raise ValueError(
                f"marginal output length {longer}: a token count >= 1 other than the output "
                f"length ({self.output_len})"
            )


def cpu_split(pin: bool) -> tuple[str | None, str | None]:
    """(the fakes' CPUs, the routers' CPUs) for ``taskset``; no pinning on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2 or shutil.which("taskset") is None:
        return None, None
    return str(cpus[0]), str(cpus[-1])


def fake_process(
    name: str,
    port: int,
    logs: Path,
    engine_id: str | None = None,
    cpus: str | None = None,
    token_delay: float = 0.0,
) -> ChildProcess:
    argv = [
        sys.executable,
        "-m",
        "devstack.fake_vllm",
        "--port",
        str(port),
        "--model",
        MODEL,
    ]
    if engine_id:
        argv += ["--engine-id", engine_id]
    if token_delay:
        argv += ["--token-delay", str(token_delay)]
    return http_process(
        name, pinned(argv, cpus), f"http://127.0.0.1:{port}/health", logs / f"{name}.log"
    )


def _summary(
    metrics: dict[str, Any], cpu_s: float, fakes_cpu_s: float, client_cpu_s: float
) -> dict[str, Any]:
    keys = (
        "completed",
        "failed",
        "request_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "median_itl_ms",
    )
    out = {k: metrics[k] for k in keys}
    done = metrics["completed"]
    out["cpu_ms_per_request"] = 1000 * cpu_s / done if done else None
    out["fakes_cpu_ms_per_request"] = 1000 * fakes_cpu_s / done if done else None
    out["client_cpu_ms_per_request"] = 1000 * client_cpu_s / done if done else None
    return out


def _cpu(pgids: list[int]) -> float:
    return sum(group_cpu_seconds(pgid) for pgid in pgids)


async def _timed_load(
    client: Any,
    target: Target,
    requests: list[Any],
    load: LoadSpec,
    pgid: int | None,
    fakes: list[int],
) -> tuple[Any, dict[str, Any]]:
    """One load on ``target``: its result and its summary, with the CPU its processes used, the
    CPU the fake instances (process groups ``fakes``) used for it, and the load generator's own
    (this process: ``time.process_time`` counts no child)."""
    before, fakes_before = (group_cpu_seconds(pgid) if pgid else 0.0), _cpu(fakes)
    client_before = time.process_time()
    result = await run_load(client, target, requests, load)
    client_used = time.process_time() - client_before
    used = group_cpu_seconds(pgid) - before if pgid else 0.0
    metrics = metrics_to_dict(result.metrics)
    return result, _summary(metrics, used, _cpu(fakes) - fakes_before, client_used)


T = TypeVar("T")


async def _stages_during(
    client: httpx.AsyncClient, name: str, metrics_url: str | None, load: Awaitable[T]
) -> tuple[T, dict[str, float] | None]:
    """Await ``load``; with ``metrics_url`` (our router's ``/metrics``) also the mean ms of each
    of its TTFT stages (``disagg_router.router.observability.timeline``) over exactly that load's
    requests."""
    if metrics_url is None:
        return await load, None
    before = await scrape(client, {name: metrics_url})
    result = await load
    return result, router_stages(before, await scrape(client, {name: metrics_url}), name)


async def measure(
    targets: dict[str, Target],
    spec: OverheadSpec,
    pgids: dict[str, int] | None = None,
    stage_metrics: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Offer the fixed-rate loads and the saturation loop to every target (interleaved);
    ``pgids``: the process group whose CPU time counts for each target (``prefill`` and
    ``direct``: the fakes', counted for every target); ``stage_metrics``: the ``/metrics`` URL
    of each target that exports our router's TTFT stages (recorded per fixed rate)."""
    pgids = pgids or {}
    stage_metrics = stage_metrics or {}
    fakes = [pgids[name] for name in ("prefill", "direct") if name in pgids]
    cores = len(os.sched_getaffinity(0))  # the load generator's, the fakes' and routers' too
    out: dict[str, Any] = {"fixed_rate": [], "saturation": {}, "cpu_count": cores}
    if spec.marginal_output_len is not None:
        out["output_lens"] = [spec.output_len, spec.marginal_output_len]
    saturated: set[str] = set()
    async with make_client() as client:
        warm = make_token_prompts(SyntheticSpec(20, spec.input_len, spec.output_len, seed=99))
        for target in targets.values():
            await run_load(client, target, warm, LoadSpec(max_concurrency=4, show_progress=False))
        for rate in spec.rates:
            n = max(int(rate * spec.seconds_per_rate), 10)
            requests = make_token_prompts(
                SyntheticSpec(n, spec.input_len, spec.output_len, seed=spec.seed)
            )
            row: dict[str, Any] = {"rate": rate, "num_requests": n, "targets": {}}
            for name, target in targets.items():
                if name in saturated:  # it could not keep up with a lower rate: skip
                    continue
                print(f"overhead: {name} at {rate:g} req/s ({n} requests)", file=sys.stderr)
                load = LoadSpec(request_rate=rate, seed=spec.seed, show_progress=False)
                timed = _timed_load(client, target, requests, load, pgids.get(name), fakes)
                (result, summary), stages = await _stages_during(
                    client, name, stage_metrics.get(name), timed
                )
                row["targets"][name] = summary
                if stages is not None:
                    summary["ttft_stages_ms"] = stages
                if result.metrics.request_throughput < 0.5 * rate:
                    saturated.add(name)
                elif spec.marginal_output_len is not None:
                    longer = _with_output_len(requests, spec.marginal_output_len)
                    print(f"overhead: {name} at {rate:g} req/s, longer answers", file=sys.stderr)
                    _, summary = await _timed_load(
                        client, target, longer, load, pgids.get(name), fakes
                    )
                    row.setdefault("marginal", {})[name] = summary
            out["fixed_rate"].append(row)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        sizes: dict[str, int] = {}
        for turn in range(spec.saturation_rounds):
            for name, target in targets.items():
                print(f"overhead: {name} saturation ({turn + 1})", file=sys.stderr)
                load = LoadSpec(max_concurrency=spec.saturation_concurrency, show_progress=False)
                if name not in sizes:
                    sizes[name] = await _saturation_size(client, target, spec, load)
                requests = make_token_prompts(
                    SyntheticSpec(sizes[name], spec.input_len, spec.output_len, seed=1 + turn)
                )
                _, summary = await _timed_load(
                    client, target, requests, load, pgids.get(name), fakes
                )
                rounds[name].append(summary)
        out["saturation"] = {name: pooled(runs) for name, runs in rounds.items()}
        out["saturation_rounds"] = rounds
    return out


def _with_output_len(requests: list[Any], output_len: int) -> list[Any]:
    """The same prompts asking for ``output_len`` tokens each."""
    return [replace(r, output_len=output_len) for r in requests]


async def _saturation_size(client: Any, target: Target, spec: OverheadSpec, load: LoadSpec) -> int:
    """Requests in one closed loop on ``target``: a short probe sizes it to about
    ``saturation_seconds`` of work, capped by ``saturation_requests``, so a slow target cannot
    stall the whole benchmark."""
    probe_n = max(2 * spec.saturation_concurrency, 20)
    probe = make_token_prompts(SyntheticSpec(probe_n, spec.input_len, spec.output_len, seed=2))
    probe_rate = (await run_load(client, target, probe, load)).metrics.request_throughput
    return min(spec.saturation_requests, max(probe_n, int(probe_rate * spec.saturation_seconds)))


_PER_REQUEST = ("cpu_ms_per_request", "fakes_cpu_ms_per_request", "client_cpu_ms_per_request")


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's closed loops as one: CPU per request over all their requests, counts
    summed, and the latencies and throughput of the round with the median throughput."""
    middle = sorted(runs, key=lambda r: r["request_throughput"])[len(runs) // 2]
    out = dict(middle)
    done = sum(r["completed"] for r in runs)
    out["completed"], out["failed"] = done, sum(r["failed"] for r in runs)
    for key in _PER_REQUEST:
        if done and all(r.get(key) is not None for r in runs):
            out[key] = sum(r[key] * r["completed"] for r in runs) / done
    return out


def derive(raw: dict[str, Any]) -> dict[str, Any]:
    """Added latency (ms) and ratios of each router against ``direct`` from the same run."""
    added: dict[str, list[dict[str, float | None]]] = {}
    for row in raw["fixed_rate"]:
        base = row["targets"].get("direct")
        if base is None:
            continue
        for name, m in row["targets"].items():
            if name == "direct":
                continue
            added.setdefault(name, []).append(
                {
                    "rate": row["rate"],
                    "added_ttft_ms_p50": m["median_ttft_ms"] - base["median_ttft_ms"],
                    "added_ttft_ms_p99": m["p99_ttft_ms"] - base["p99_ttft_ms"],
                    "added_e2el_ms_p50": m["median_e2el_ms"] - base["median_e2el_ms"],
                    "added_e2el_ms_p99": m["p99_e2el_ms"] - base["p99_e2el_ms"],
                    "e2el_p50_ratio": _ratio(m["median_e2el_ms"], base["median_e2el_ms"]),
                    "e2el_p99_ratio": _ratio(m["p99_e2el_ms"], base["p99_e2el_ms"]),
                    "achieved_rate": m["request_throughput"],
                    "cpu_ms_per_request": m.get("cpu_ms_per_request"),
                    "ttft_stages_ms": m.get("ttft_stages_ms"),
                }
            )
    sat = raw["saturation"]
    base_rate = sat["direct"]["request_throughput"]
    saturation = {
        name: {
            "max_request_rate": m["request_throughput"],
            "ratio_to_direct": _ratio(m["request_throughput"], base_rate),
            "failed": m["failed"],
            "cpu_ms_per_request": m.get("cpu_ms_per_request"),
            **_fakes_limit(m.get("fakes_cpu_ms_per_request"), base_rate),
            **_machine_limit(m, base_rate, raw.get("cpu_count")),
        }
        for name, m in sat.items()
    }
    return {"added": added, "saturation": saturation, "marginal": marginal(raw)}


def marginal(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fixed rate run at two output lengths (``raw["output_lens"]``): the CPU each relayed
    token adds for each target, in microseconds (its CPU per request at the longer length less
    at the shorter, over the tokens between), and each one over ``vllm-router``'s and over the
    floor's. Empty when the run had one output length."""
    lens: list[int] | None = raw.get("output_lens")
    if not lens:
        return []
    out: list[dict[str, Any]] = []
    for row in raw["fixed_rate"]:
        us: dict[str, float] = {}
        for name, longer in row.get("marginal", {}).items():
            short = row["targets"][name].get("cpu_ms_per_request")
            long = longer.get("cpu_ms_per_request")
            if short is not None and long is not None:
                us[name] = (long - short) * 1000 / (lens[1] - lens[0])
        out.append(
            {
                "rate": row["rate"],
                "output_lens": lens,
                "us_per_token": us,
                "over_vllm_router": _over(us, "vllm-router"),
                "over_floor": _over(us, "floor"),
            }
        )
    return out


def _over(us: dict[str, float], base: str) -> dict[str, float | None]:
    """Each target's figure over ``base``'s (none when ``base`` has none)."""
    if base not in us:
        return {}
    return {name: _ratio(value, us[base]) for name, value in us.items() if name != base}


def _machine_limit(
    m: dict[str, Any], direct_rate: float, cpu_count: int | None
) -> dict[str, float | None]:
    """What the whole machine caps, from one target's closed loop: the load generator and the
    fakes took ``client + fakes`` ms of CPU per request, so on ``cpu_count`` cores no router in
    front, even one that cost nothing, could pass ``cpu_count * 1000 / (client + fakes)`` req/s
    (``machine_limit_over_direct``: that cap / direct's measured rate). None when a cost or the
    core count is unknown."""
    client, fakes = m.get("client_cpu_ms_per_request"), m.get("fakes_cpu_ms_per_request")
    if not client or not fakes or not cpu_count:
        return {"client_cpu_ms_per_request": client, "machine_limit_over_direct": None}
    limit = cpu_count * 1000 / (client + fakes)
    return {
        "client_cpu_ms_per_request": client,
        "machine_limit_over_direct": _ratio(limit, direct_rate),
    }


def _fakes_limit(fakes_ms: float | None, direct_rate: float) -> dict[str, float | None]:
    """The fakes' CPU per request of one target's closed loop, and what it caps: the fakes share
    one pinned core, so no target can pass ``1000 / fakes_ms`` req/s on it, whatever a router in
    front costs (``fakes_limit_over_direct``: that cap / direct's measured rate)."""
    limit = 1000 / fakes_ms if fakes_ms else None
    return {
        "fakes_cpu_ms_per_request": fakes_ms,
        "fakes_limit_rps": limit,
        "fakes_limit_over_direct": _ratio(limit, direct_rate) if limit else None,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def format_report(derived: dict[str, Any]) -> str:
    """Markdown tables of the derived numbers."""
    lines = [
        "| router | rate (req/s) | added TTFT p50 / p99 (ms) | added E2EL p50 / p99 (ms) "
        "| E2EL p50 / p99 vs direct | achieved req/s | router CPU ms/request |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in derived["added"].items():
        for r in rows:
            lines.append(
                f"| {name} | {r['rate']:g} | {r['added_ttft_ms_p50']:.2f} / "
                f"{r['added_ttft_ms_p99']:.2f} | {r['added_e2el_ms_p50']:.2f} / "
                f"{r['added_e2el_ms_p99']:.2f} | {_fmt(r['e2el_p50_ratio'])} / "
                f"{_fmt(r['e2el_p99_ratio'])} | {r.get('achieved_rate', 0):.1f} "
                f"| {_ms(r.get('cpu_ms_per_request'))} |"
            )
    lines += [
        "",
        "| target | sustained req/s (closed loop) | vs direct | failed | CPU ms/request "
        "| fakes' CPU ms/request | fakes' core limit vs direct | load generator CPU ms/request "
        "| machine limit vs direct |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in derived["saturation"].items():
        lines.append(
            f"| {name} | {s['max_request_rate']:.1f} | {_fmt(s['ratio_to_direct'])} "
            f"| {s['failed']} | {_ms(s.get('cpu_ms_per_request'))} "
            f"| {_ms(s.get('fakes_cpu_ms_per_request'))} "
            f"| {_fmt(s.get('fakes_limit_over_direct'))} "
            f"| {_ms(s.get('client_cpu_ms_per_request'))} "
            f"| {_fmt(s.get('machine_limit_over_direct'))} |"
        )
    return "\n".join(lines + _stages_table(derived["added"]) + _marginal_table(derived))


def _marginal_table(derived: dict[str, Any]) -> list[str]:
    """Markdown lines: the CPU each relayed token adds, per target and fixed rate (none when
    the run had one output length)."""
    rows = derived.get("marginal") or []
    if not rows:
        return []
    short, long = rows[0]["output_lens"]
    lines = [
        "",
        f"| target | rate (req/s) | CPU us per relayed token (slope, {short} to {long} tokens) "
        "| over `vllm-router` | over floor |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for name, us in r["us_per_token"].items():
            lines.append(
                f"| {name} | {r['rate']:g} | {us:.1f} | {_fmt(r['over_vllm_router'].get(name))} "
                f"| {_fmt(r['over_floor'].get(name))} |"
            )
    return lines


def _stages_table(added: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown lines: each router's mean TTFT stages per fixed rate (none if none recorded)."""
    rows = [(name, r) for name, rs in added.items() for r in rs if r.get("ttft_stages_ms")]
    if not rows:
        return []
    lines = [
        "",
        "| router | rate (req/s) | " + " | ".join(f"{s} (ms)" for s in STAGES) + " | sum (ms) |",
        "|---|---|" + "---|" * (len(STAGES) + 1),
    ]
    for name, r in rows:
        stages = r["ttft_stages_ms"]
        cells = " | ".join(_ms(stages.get(s)) for s in STAGES)
        lines.append(f"| {name} | {r['rate']:g} | {cells} | {_ms(sum(stages.values()))} |")
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def run_overhead(spec: OverheadSpec, log_dir: Path | None = None) -> dict[str, Any]:
    """Start the processes, measure, stop them; returns raw and derived numbers."""
    p_port, d_port, r_port, v_port, f_port, b_port = free_ports(6)
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    fake_cpus, router_cpus = cpu_split(spec.pin)
    pgids: dict[str, int] = {}

    def started(name: str, process: ChildProcess) -> None:
        stack.enter_context(process)
        if process.pid is not None:
            pgids[name] = process.pid

    with ExitStack() as stack:
        logs = stack.enter_context(log_folder(log_dir, "bench-overhead-"))
        delay = spec.token_delay
        p_fake = fake_process("fake-prefill", p_port, logs, PREFILL_ENGINE_ID, fake_cpus, delay)
        started("prefill", p_fake)
        started("direct", fake_process("fake-decode", d_port, logs, None, fake_cpus, delay))
        targets = {"direct": Target(d_url, MODEL)}
        config = router_config(MODEL, p_url, d_url, identity=FAKE_PREFILL_IDENTITY)
        if "ours" in spec.routers:
            started("ours", our_router(config, r_port, logs, cpus=router_cpus))
            targets["ours"] = Target(f"http://127.0.0.1:{r_port}", MODEL)
        if spec.baseline is not None:
            source = Path(spec.baseline)
            base = our_router(config, b_port, logs, cpus=router_cpus, source=source)
            started("baseline", base)
            targets["baseline"] = Target(f"http://127.0.0.1:{b_port}", MODEL)
        if "floor" in spec.routers:
            floor = floor_router(p_url, d_url, FAKE_PREFILL_IDENTITY, f_port, logs, router_cpus)
            started("floor", floor)
            targets["floor"] = Target(f"http://127.0.0.1:{f_port}", MODEL)
        if "vllm-router" in spec.routers:
            started("vllm-router", vllm_router(p_url, d_url, v_port, logs, cpus=router_cpus))
            targets["vllm-router"] = Target(f"http://127.0.0.1:{v_port}", MODEL)
        stage_metrics = {
            "ours": f"http://127.0.0.1:{r_port}/metrics",
            "baseline": f"http://127.0.0.1:{b_port}/metrics",
        }
        raw = asyncio.run(measure(targets, spec, pgids, stage_metrics))
    cpus = {"fakes": fake_cpus, "routers": router_cpus}
    return {
        "spec": spec.__dict__,
        "cpus": cpus,
        "raw": raw,
        "derived": derive(raw),
    }
