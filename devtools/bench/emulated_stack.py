"""An emulated stack for the scenario sweep: the same P/D (or aggregated) topology as a real
vLLM group, served by one emulator process (``python -m devstack.emulator``).

Who calls it: :mod:`bench.emulator_accuracy`, which passes :func:`start_emulated` to the
scenario sweep in place of the real stack's starter, so the sweep, its routers and its load are
exactly those of the real run; the fleet benchmarks (:mod:`bench.fleet_scale`,
:mod:`bench.churn`, :mod:`bench.fleet_binding`, :mod:`bench.fleet_failover`, :mod:`bench.plan`)
start a fleet and our router over it with :func:`fleet_behind_router`; :mod:`bench.fleet_routing`,
with several routers, with :func:`emulator_process` and :func:`fleet_instances`.
:class:`EmulatedStack` offers what the sweep uses of :class:`devstack.stack.Stack`: the model
name, the instances of each role, the router config, ``stop()``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.overhead import cpu_split
from bench.routers import our_router, pinned, router_config_path
from bench.scenarios import InstanceGroup
from devstack.connectors import router_mode
from devstack.emulator.profile import load_profile
from devstack.ports import free_port, free_ports
from devstack.process import ChildProcess, http_process
from devstack.stack import DECODE_CORE, PREFILL_CORE


@dataclass(frozen=True)
class EmulatedInstance:
    name: str
    url: str


class EmulatedStack:
    """A running emulated group; the caller stops it."""

    def __init__(
        self, process: ChildProcess, instances: dict[str, Any], group: InstanceGroup, model: str
    ) -> None:
        self._process = process
        self.model_name = model
        self.mode = router_mode(group.kind)
        roles = {
            role: [EmulatedInstance(i["name"], i["url"]) for i in found]
            for role, found in instances.items()
        }
        aggregated = group.topology == "aggregated"
        self.prefill = [] if aggregated else roles["prefill"]
        self.decode = [] if aggregated else roles["decode"]
        self.aggregated = roles["decode"] if aggregated else []

    def router_config(self, with_identity: bool = False) -> dict[str, Any]:
        """The router config of the real stack's :meth:`devstack.stack.Stack.router_config`
        (round robin, identities probed)."""
        del with_identity  # an emulated P answers identity probes like ours
        return {
            "models": [self.model_name],
            "mode": self.mode,
            "prefill": {"instances": [vars(i) for i in self.prefill], "policy": "round_robin"},
            "decode": {"instances": [vars(i) for i in self.decode], "policy": "round_robin"},
            "health": {"interval": 30.0},
        }

    def stop(self) -> None:
        self._process.stop()


def emulator_process(
    *,
    prefill: int,
    decode: int,
    control_port: int,
    log: Path,
    profile: str = "cpu-tiny",
    cpus: str | None = None,
    transfer_mode: str = "push",
    kv_events: bool = True,
    decode_num_blocks: int | None = None,
    cpu_cores: tuple[int, ...] = (),
) -> ChildProcess:
    """An unstarted ``python -m devstack.emulator`` fleet on ``cpus`` (``taskset`` list; None:
    unpinned), ready once its control port answers ``/health``; ``decode_num_blocks``: D's KV
    cache when smaller than the profile's; ``cpu_cores``: the engines that spend their steps as
    CPU time on a core (``--cpu-cores``)."""
    argv = [sys.executable, "-m", "devstack.emulator", "--profile", profile]
    argv += ["--prefill", str(prefill), "--decode", str(decode)]
    argv += ["--transfer-mode", transfer_mode, "--control-port", str(control_port)]
    if not kv_events:
        argv.append("--no-kv-events")
    if decode_num_blocks is not None:
        argv += ["--decode-num-blocks", str(decode_num_blocks)]
    if cpu_cores:
        argv += ["--cpu-cores", ",".join(map(str, cpu_cores))]
    ready = f"http://127.0.0.1:{control_port}/health"
    return http_process("emulator", pinned(argv, cpus), ready, log, ready_timeout_s=60.0)


@dataclass(frozen=True)
class FleetSetup:
    """An emulated fleet's shape and options (those of :func:`emulator_process`)."""

    prefill: int
    decode: int
    profile: str
    transfer_mode: str = "push"
    kv_events: bool = False
    decode_num_blocks: int | None = None


@dataclass(frozen=True)
class RunningFleet:
    """What :func:`fleet_behind_router` started: the fleet's instances by role and control URL,
    the router's URL, process and config file."""

    instances: dict[str, list[dict[str, Any]]]
    control_url: str
    router_url: str
    router: ChildProcess
    config_path: Path


RouterConfig = Callable[[dict[str, list[dict[str, Any]]]], dict[str, Any]]
"""The router's config for a fleet's instances by role."""


def fewest_in_flight_config(
    instances: dict[str, list[dict[str, Any]]], model: str, mode: str = "push", **more: Any
) -> dict[str, Any]:
    """Our router's config over an emulated fleet's ``instances``: ``mode``, P and D each by
    fewest legs in flight, and the sections in ``more`` (``push``, ``health``, ``timeouts``...).
    The config the fleet benchmarks share; each names what it adds."""
    return {
        "models": [model],
        "mode": mode,
        "prefill": {"policy": "least_in_flight", "instances": instances["prefill"]},
        "decode": {"policy": "least_in_flight", "instances": instances["decode"]},
        **more,
    }


@contextmanager
def fleet_behind_router(
    setup: FleetSetup,
    config: RouterConfig,
    logs: Path,
    ready_timeout_s: float = 60.0,
    log_level: str = "warning",
) -> Iterator[RunningFleet]:
    """An emulated fleet (one process on the first core) and our router over it (the last core,
    ``config`` of the fleet's instances), both stopped when the block ends, also on an error.
    Who calls it: the fleet benchmarks (binding, failover, scale, churn, the planner); each
    call starts a fresh pair, so no run sees another's caches or counters."""
    fleet_cpus, router_cpus = cpu_split(pin=True)
    control, port = free_ports(2)
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        fleet = emulator_process(
            prefill=setup.prefill,
            decode=setup.decode,
            control_port=control,
            log=logs / "fleet.log",
            profile=setup.profile,
            cpus=fleet_cpus,
            transfer_mode=setup.transfer_mode,
            kv_events=setup.kv_events,
            decode_num_blocks=setup.decode_num_blocks,
        )
        stack.enter_context(fleet)
        instances = fleet_instances(control)
        process = our_router(
            config(instances), port, logs, ready_timeout_s, router_cpus, log_level=log_level
        )
        router = stack.enter_context(process)
        yield RunningFleet(
            instances,
            f"http://127.0.0.1:{control}",
            f"http://127.0.0.1:{port}",
            router,
            router_config_path(logs, port),
        )


def fleet_instances(control_port: int) -> dict[str, list[dict[str, Any]]]:
    """The router config entries of a running fleet's instances, by role."""
    found: dict[str, list[dict[str, Any]]] = httpx.get(
        f"http://127.0.0.1:{control_port}/instances", timeout=10
    ).json()
    return found


def twin_cores(aggregated: bool, cpu_steps: bool) -> tuple[int, tuple[int, ...]]:
    """Where a pinned emulated twin runs: the emulator process's core, and the cores its
    engines spend their steps on (none unless ``cpu_steps``; else P's then D's, an aggregated
    engine on P's core as the real one is).

    Without ``cpu_steps`` the emulator runs on P's core. With it, on D's core: for an
    aggregated twin that is off the engine's core (the emulator's HTTP work stands for the API
    server, whose CPU the fitted steps already hold); for 1P1D no core is free, and D's is the
    one where extra work costs least: there it lengthens decode steps by its streaming, as the
    real D's API server streams every token beside D's engine, while P's prefill steps run back
    to back under load, where any extra work on their core turns into queueing before P."""
    if not cpu_steps:
        return PREFILL_CORE, ()
    return DECODE_CORE, (PREFILL_CORE,) if aggregated else (PREFILL_CORE, DECODE_CORE)


def start_emulated(
    group: InstanceGroup,
    work_dir: Path,
    profile: str = "cpu-tiny",
    pin_processes: bool = False,
    cpu_steps: bool = False,
) -> EmulatedStack:
    """Start ``group``'s topology emulated (one P and one D, or one aggregated engine);
    ``pin_processes``: the emulator pinned as :func:`twin_cores` says, as the real instances'
    processes are pinned; ``cpu_steps`` (with ``pin_processes``): each engine spends its steps
    as CPU time on its real twin's core, shared as the twin shares it."""
    aggregated = group.topology == "aggregated"
    home, cores = twin_cores(aggregated, pin_processes and cpu_steps)
    port = free_port()
    process = emulator_process(
        prefill=0 if aggregated else 1,
        decode=1,
        control_port=port,
        log=work_dir / "emulator.log",
        profile=profile,
        cpus=str(home) if pin_processes else None,
        transfer_mode=router_mode(group.kind),
        kv_events=False,
        cpu_cores=cores,
    )
    process.start()
    try:
        instances = fleet_instances(port)
    except httpx.HTTPError:
        process.stop()
        raise
    return EmulatedStack(process, instances, group, load_profile(profile).model)
