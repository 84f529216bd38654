"""Whole development stacks of real vLLM CPU instances: 1P1D, 2P1D or one aggregated instance.

Who calls it: e2e fixtures, the demo, benchmarks and deploy scripts. :func:`start_stack` picks free
loopback ports, assigns each instance a fixed NIXL engine id, starts all instances at once and
returns a :class:`Stack`; the caller must :meth:`Stack.stop` it (or use it as a context manager).
:meth:`Stack.router_config` renders the router's YAML config (``disagg_router.router.config``
schema) for the stack, with or without the prefill identities (without them the router probes for
them).

Core pinning (sized for a 2-core machine): prefill instances on core 0, decode instances on
core 1; an aggregated instance on ``aggregated_core`` (default 0). A tensor-parallel instance
(``StackOptions.tensor_parallel``) or pipeline-parallel one (``StackOptions.pipeline_parallel``)
pins all its workers to its own core, so P and D never share one
(``VllmServerSpec.tensor_parallel_size`` says why).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx
import yaml

from devstack.connectors import kv_transfer_config, router_mode
from devstack.ports import free_port_runs, free_ports
from devstack.tiny_model import ModelShape, make_tiny_model
from devstack.vllm_server import (
    DEFAULT_STARTUP_TIMEOUT_S,
    VllmServer,
    VllmServerSpec,
    start_servers,
    stop_servers,
)

Topology = Literal["1p1d", "1p2d", "2p1d", "2p2d", "3p2d", "aggregated"]
InstanceRole = Literal["prefill", "decode", "aggregated"]
TOPOLOGIES: tuple[Topology, ...] = ("1p1d", "1p2d", "2p1d", "2p2d", "3p2d", "aggregated")
MODEL_NAME = "tiny"
PREFILL_CORE = 0
DECODE_CORE = 1


@dataclass(frozen=True)
class StackInstance:
    """One instance of a stack: its role, server and (for P/D) NIXL identity."""

    role: InstanceRole
    server: VllmServer
    engine_id: str | None
    side_channel_port: int | None
    kv_events_ports: tuple[int, int] | None = None
    """Its KV event publisher (``tcp://*:port``) and replay ports when the stack has
    ``kv_events``."""
    tp_size: int = 1
    """Tensor-parallel size (its P side channels listen on ``side_channel_port + rank``)."""
    pp_size: int = 1
    """Pipeline-parallel size (P's worker of vLLM rank ``stage * tp_size + tp_rank`` listens
    on ``side_channel_port`` + that rank)."""

    @property
    def kv_endpoints(self) -> dict[str, str]:
        """The router's per-instance ``kv_events_endpoint`` and ``kv_replay_endpoint``."""
        if self.kv_events_ports is None:
            return {}
        host = self.server.spec.host
        pub, replay = self.kv_events_ports
        return {
            "kv_events_endpoint": f"tcp://{host}:{pub}",
            "kv_replay_endpoint": f"tcp://{host}:{replay}",
        }

    @property
    def name(self) -> str:
        return self.server.spec.name

    @property
    def url(self) -> str:
        return self.server.url


@dataclass(frozen=True)
class StackOptions:
    """Knobs for :func:`start_stack`; the defaults suit the e2e suite."""

    kind: str = "vllm-push"
    topology: Topology = "1p1d"
    aggregated_core: int = PREFILL_CORE
    with_aggregated: bool = False
    """Add one aggregated instance ``a0`` (no KV connector) beside a 1p1d/2p1d stack."""
    model_name: str = MODEL_NAME
    max_model_len: int = 16384
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    in_process_worker: bool = True
    """Model worker inside the engine-core process (see :mod:`devstack.vllm_server`)."""
    pin_processes: bool = False
    """Confine each instance's whole process to its core (:attr:`VllmServerSpec.pin_process`)."""
    extra_args: Sequence[str] = ()
    instance_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """More vLLM arguments per instance name, after ``extra_args`` (e.g. a D's
    ``--num-gpu-blocks-override``)."""
    enforce_eager: bool = False
    """Run vLLM without torch.compile (``--enforce-eager``) on every instance that allows it: a
    tiny-model instance is then ready after about 20 s of CPU instead of 37 (one instance alone on
    this 2-core machine), and nothing the router or connector does depends on the compiled
    graph. Pipeline-parallel instances keep the compiled mode: vLLM CPU 0.32's eager path never
    allocates a later stage's intermediate tensors (the first request fails an assertion in
    ``sync_and_gather_intermediate_tensors``)."""
    kv_events: bool = False
    """Every instance publishes its KV events (vLLM's ZMQ publisher, with a replay socket)."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    model_shape: ModelShape = "llama"
    """Which tiny model every instance serves (:data:`devstack.tiny_model.SHAPES`)."""
    tensor_parallel: Mapping[str, int] = field(default_factory=dict)
    """Tensor-parallel size per instance name (default 1), e.g. ``{"p1": 2, "d1": 2}``."""
    pipeline_parallel: Mapping[str, int] = field(default_factory=dict)
    """Pipeline-parallel size per instance name (default 1), e.g. ``{"p1": 2}`` (the connector
    serves it on P only)."""


class Stack:
    """A running set of instances. Stop it exactly once (idempotent)."""

    def __init__(self, options: StackOptions, model_dir: Path, instances: list[StackInstance]):
        self.options = options
        self.model_dir = model_dir
        self.instances = instances

    @property
    def model_name(self) -> str:
        return self.options.model_name

    @property
    def mode(self) -> Literal["push", "pull"]:
        return router_mode(self.options.kind)

    def _by_role(self, role: InstanceRole) -> list[StackInstance]:
        return [i for i in self.instances if i.role == role]

    @property
    def prefill(self) -> list[StackInstance]:
        return self._by_role("prefill")

    @property
    def decode(self) -> list[StackInstance]:
        return self._by_role("decode")

    @property
    def aggregated(self) -> list[StackInstance]:
        return self._by_role("aggregated")

    def router_config(
        self,
        *,
        with_identity: bool = False,
        prefill_policy: str = "round_robin",
        decode_policy: str = "round_robin",
        timeouts: Mapping[str, float] | None = None,
        health_interval_s: float = 30.0,
        identity_interval_s: float | None = None,
        prefill_names: Sequence[str] | None = None,
        kv_events: bool = False,
    ) -> dict[str, Any]:
        """The router config mapping (validate with
        ``disagg_router.router.config.settings_from_mapping``).

        ``with_identity`` writes each prefill instance's push identity into the config; without
        it the router must probe the instances for their identities. ``prefill_names`` limits
        the prefill pool to those instances (e.g. a 1P1D router on a 2P1D stack).
        ``identity_interval_s`` sets how often the router re-probes a healthy P's identity; each
        probe keeps a block on P (and P's engine loop busy) for P's KV lease.
        ``kv_events`` (a stack started with ``kv_events``): the router follows every instance's
        KV events, with the model directory's tokenizer (for the ``kv_aware`` policy).
        """
        prefill = [i for i in self.prefill if prefill_names is None or i.name in prefill_names]
        if not prefill or not self.decode:
            raise ValueError("router_config needs at least one prefill and one decode instance")
        prefill_instances: list[dict[str, Any]] = []
        for inst in prefill:
            entry: dict[str, Any] = {"url": inst.url, "name": inst.name}
            if kv_events:
                entry.update(inst.kv_endpoints)
            if with_identity:
                entry["identity"] = {
                    "engine_id": inst.engine_id,
                    "host": inst.server.spec.host,
                    "port": inst.side_channel_port,
                    "tp_size": inst.tp_size,
                    "pp_size": inst.pp_size,
                }
            prefill_instances.append(entry)
        config: dict[str, Any] = {
            "models": [self.model_name],
            "mode": self.mode,
            "prefill": {"instances": prefill_instances, "policy": prefill_policy},
            "decode": {
                "instances": [
                    {"url": i.url, "name": i.name, **(i.kv_endpoints if kv_events else {})}
                    for i in self.decode
                ],
                "policy": decode_policy,
            },
            "health": {"interval": health_interval_s},
        }
        if kv_events:
            config["kv_events"] = {"enabled": True, "tokenizer": str(self.model_dir)}
        if identity_interval_s is not None:
            config["health"]["identity_interval"] = identity_interval_s
        if timeouts:
            config["timeouts"] = dict(timeouts)
        return config

    def write_router_config(self, path: Path, **kwargs: Any) -> Path:
        """Write :meth:`router_config` as YAML to ``path`` and return it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.router_config(**kwargs), sort_keys=False))
        return path

    def describe(self) -> str:
        """One line per instance: role, name, URL, engine id, side-channel port, log."""
        return "\n".join(
            f"{i.role:<10} {i.name:<4} {i.url} engine={i.engine_id} "
            f"nixl_port={i.side_channel_port} log={i.server.log_path}"
            for i in self.instances
        )

    def warm_up(self, prompt_tokens: int = 600, timeout_s: float = 300.0) -> dict[str, float]:
        """Send one plain long-prompt request to every instance; return seconds per instance.

        A fresh vLLM CPU instance answers its first large prefill very slowly (tens of seconds on
        a loaded machine). Call this before starting a router, so its health checks, identity
        probes and first-token timeouts never see that.
        """
        prompt = " ".join(f"warm{i % 97}" for i in range(prompt_tokens // 2))
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        took: dict[str, float] = {}
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as client:
            for inst in self.instances:
                started = time.monotonic()
                client.post(f"{inst.url}/v1/completions", json=body).raise_for_status()
                took[inst.name] = time.monotonic() - started
        return took

    def stop(self) -> None:
        stop_servers([i.server for i in self.instances])

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _plan(options: StackOptions) -> list[tuple[InstanceRole, str, int]]:
    """(role, name, core) for each instance of the topology: ``NpMd`` is P instances ``p0``..
    on P's core and D instances ``d0``.. on D's core."""
    if options.topology == "aggregated":
        return [("aggregated", "a0", options.aggregated_core)]
    if options.topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {options.topology!r}; expected one of {TOPOLOGIES}")
    num_p, num_d = int(options.topology[0]), int(options.topology[2])
    plan: list[tuple[InstanceRole, str, int]] = [
        ("prefill", f"p{i}", PREFILL_CORE) for i in range(num_p)
    ]
    plan += [("decode", f"d{i}", DECODE_CORE) for i in range(num_d)]
    if options.with_aggregated:
        plan.append(("aggregated", "a0", options.aggregated_core))
    return plan


def build_specs(
    options: StackOptions, model_dir: Path, log_dir: Path
) -> list[tuple[InstanceRole, str | None, VllmServerSpec]]:
    """The server specs of a stack (ports chosen now), with each instance's role and engine id."""
    plan = _plan(options)
    per = 4 if options.kv_events else 2
    ports = free_ports(per * len(plan))
    workers = max(
        options.tensor_parallel.get(name, 1) * options.pipeline_parallel.get(name, 1)
        for _, name, _ in plan
    )
    side_channels = free_port_runs(len(plan), workers) if workers > 1 else []
    result: list[tuple[InstanceRole, str | None, VllmServerSpec]] = []
    run_id = uuid.uuid4().hex[:8]
    for index, (role, name, core) in enumerate(plan):
        http_port, nixl_port = ports[per * index], ports[per * index + 1]
        if side_channels:  # room for every rank's side channel
            nixl_port = side_channels[index]
        engine_id: str | None = None
        kv_config: dict[str, Any] | None = None
        if role != "aggregated":
            engine_id = f"{name}-{run_id}"
            kv_config = kv_transfer_config(
                options.kind, role, options.connector_extra_config or None
            )
            kv_config["engine_id"] = engine_id
        spec = VllmServerSpec(
            name=name,
            model_dir=model_dir,
            port=http_port,
            cpu_core=core,
            log_file=log_dir / f"{name}-{options.kind}-{run_id}.log",
            served_model_name=options.model_name,
            kv_transfer_config=kv_config,
            nixl_side_channel_port=nixl_port if role != "aggregated" else None,
            max_model_len=options.max_model_len,
            in_process_worker=options.in_process_worker,
            pin_process=options.pin_processes,
            extra_env=options.extra_env,
            extra_args=(
                *options.extra_args,
                *options.instance_args.get(name, ()),
                *_eager_args(options, name),
                *_kv_events_args(options, ports, per * index),
            ),
            tensor_parallel_size=options.tensor_parallel.get(name, 1),
            pipeline_parallel_size=options.pipeline_parallel.get(name, 1),
        )
        result.append((role, engine_id, spec))
    return result


def _eager_args(options: StackOptions, name: str) -> tuple[str, ...]:
    """``--enforce-eager`` where :attr:`StackOptions.enforce_eager` asks for it and the instance
    is not pipeline parallel."""
    if options.enforce_eager and options.pipeline_parallel.get(name, 1) == 1:
        return ("--enforce-eager",)
    return ()


def _kv_events_args(options: StackOptions, ports: Sequence[int], first: int) -> tuple[str, ...]:
    """``--kv-events-config`` for one instance: PUB on ``ports[first + 2]`` (vLLM binds a
    wildcard endpoint and connects to a host one, so the PUB listens on every interface, as with
    vLLM's default), replay on loopback ``ports[first + 3]``."""
    if not options.kv_events:
        return ()
    pub, replay = ports[first + 2], ports[first + 3]
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    return ("--kv-events-config", json.dumps(config))


def _kv_events_ports(spec: VllmServerSpec) -> tuple[int, int] | None:
    args = list(spec.extra_args)
    if "--kv-events-config" not in args:
        return None
    config = json.loads(args[args.index("--kv-events-config") + 1])
    pub, replay = (int(config[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint"))
    return pub, replay


def start_stack(options: StackOptions, work_dir: Path) -> Stack:
    """Make the tiny model under ``work_dir``, start every instance concurrently, wait for health.

    Logs go to ``work_dir/logs``. On failure every instance is stopped and the error (with the
    failing instance's log tail) propagates.
    """
    suffix = "" if options.model_shape == "llama" else f"-{options.model_shape}"
    model_dir = make_tiny_model(work_dir / f"tiny-model{suffix}", options.model_shape)
    planned = build_specs(options, model_dir, work_dir / "logs")
    servers = start_servers([spec for _, _, spec in planned], options.startup_timeout_s)
    instances = [
        StackInstance(
            role=role,
            server=server,
            engine_id=engine_id,
            side_channel_port=spec.nixl_side_channel_port,
            kv_events_ports=_kv_events_ports(spec),
            tp_size=spec.tensor_parallel_size,
            pp_size=spec.pipeline_parallel_size,
        )
        for (role, engine_id, spec), server in zip(planned, servers, strict=True)
    ]
    return Stack(options, model_dir, instances)
