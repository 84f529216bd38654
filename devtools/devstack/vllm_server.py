"""Start, health-check, inspect and stop real vLLM CPU OpenAI servers.

Who calls it: e2e fixtures, the demo, benchmarks and :mod:`devstack.stack`. The caller owns
the :class:`VllmServer` and must call :meth:`VllmServer.stop` (or use it as a context manager).

Contract:
- a :class:`VllmServer` is a :class:`~devstack.process.ChildProcess` (own process group,
  parent-death signal, log file, readiness on ``/health``) running
  ``python -m vllm.entrypoints.openai.api_server``, with its OpenMP threads pinned to one CPU core
  and its NIXL side channel on the given port;
- :meth:`~devstack.process.ChildProcess.wait_ready` polls ``/health`` and fails fast, with the log
  tail, if the process exits; :meth:`~devstack.process.ChildProcess.stop` sends SIGTERM to the
  whole group (API server and engine core), then SIGKILL, and leaves no orphans;
- the model worker runs inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  which keeps vLLM's CPU platform on its in-process executor) unless ``in_process_worker`` is
  off: with one worker the separate worker process only adds a shared-memory queue that both
  sides busy-poll for 1 s after every message, costly on a 2-core machine, and with vLLM 0.32's
  ``NixlPushConnector`` that queue deadlocked P here (docs/notes/vllm-facts.md);
- :func:`start_servers` launches several servers at once (startup takes ~90 s each) and waits for
  all of them; if any fails, all are stopped.

:meth:`VllmServer.launch` must be called from a long-lived thread (see
:mod:`devstack.process`): the parent-death signal fires when the launching thread exits.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.ports import LOOPBACK
from devstack.process import ChildProcess, ProcessSpec, ProcessStartError, start_all, stop_all

DEFAULT_STARTUP_TIMEOUT_S = 300.0
STOP_GRACE_S = 15.0


VLLM_SHM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")
"""The ``/dev/shm`` files a vLLM CPU instance's processes map and a killed instance leaves behind:
the TP/PP workers' ``vllm_dist_*-cpushm_*`` segments (never unlinked, even on a clean stop), the
engine's message-queue rings (``psm_*``, 160 MiB each) and multiprocessing's semaphores
(``sem.mp-*``); :meth:`devstack.process.ChildProcess.stop` removes those the instance mapped."""


class VllmServerError(ProcessStartError):
    """A vLLM server failed to start, died, or could not be queried."""


@dataclass(frozen=True)
class VllmServerSpec:
    """Everything needed to launch one vLLM CPU instance.

    ``kv_transfer_config`` is passed verbatim as ``--kv-transfer-config`` JSON (see
    :mod:`devstack.connectors`); ``nixl_side_channel_port`` must be unique per instance
    that uses a NIXL connector. ``log_file`` receives stdout and stderr.
    """

    name: str
    model_dir: Path
    port: int
    cpu_core: int
    log_file: Path
    host: str = LOOPBACK
    served_model_name: str = "tiny"
    kv_transfer_config: Mapping[str, Any] | None = None
    nixl_side_channel_port: int | None = None
    max_model_len: int = 16384
    load_format: str = "auto"
    kv_cache_space_gib: int = 1
    in_process_worker: bool = True
    pin_process: bool = False
    """Confine the whole process (API server, engine loop, connector threads), not only its
    OpenMP compute threads, to ``cpu_core`` (``taskset``)."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    tensor_parallel_size: int = 1
    """Workers of the instance (``--tensor-parallel-size``, multiprocess executor). Every worker's
    OpenMP threads are pinned to ``cpu_core``, the instance's own core: vLLM's workers busy-poll
    their shared-memory queue for a second after each step, so a worker placed on another
    instance's core starves that instance (on a 2-core machine, P's side-channel threads went
    unanswered for seconds). With a NIXL connector worker ``r``'s side channel listens on
    ``nixl_side_channel_port + r``."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (``--pipeline-parallel-size``, multiprocess executor): ``tp * pp``
    workers, all pinned to ``cpu_core`` like the TP workers; with a NIXL connector the worker
    of vLLM rank ``r`` (``stage * tp + tp_rank``) listens on ``nixl_side_channel_port + r``."""

    @property
    def workers(self) -> int:
        """Worker processes of the instance (``tensor_parallel_size * pipeline_parallel_size``)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The argv that launches this server."""
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--load-format",
            self.load_format,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            "0",
        ]
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        if self.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.workers > 1:
            argv += ["--distributed-executor-backend", "mp"]
        argv += list(self.extra_args)
        if self.pin_process:
            argv = ["taskset", "-c", str(self.cpu_core), *argv]
        return argv

    def omp_threads_bind(self) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND``: every worker on ``cpu_core``, ``|``-separated."""
        return "|".join(str(self.cpu_core) for _ in range(self.workers))

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process environment: ``base`` (default: ours) plus the pinning/offline settings."""
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": self.omp_threads_bind(),
                "KMP_BLOCKTIME": "0",
                "OMP_WAIT_POLICY": "PASSIVE",
                "VLLM_HOST_IP": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.nixl_side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_side_channel_port)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process_worker else "1"
        env.update(self.extra_env)
        return env


def read_metrics_text(text: str) -> dict[str, float]:
    """Sum Prometheus samples by name over all labels, e.g. ``vllm:num_requests_running``."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


@dataclass(frozen=True)
class EngineLoad:
    """The load figures read from one instance's ``/metrics``."""

    running: float
    waiting: float
    kv_cache_usage: float


class VllmServer(ChildProcess):
    """One running (or starting) vLLM server process; ``spec`` says what it serves."""

    start_error = VllmServerError

    def __init__(self, spec: VllmServerSpec) -> None:
        super().__init__(
            ProcessSpec(
                name=spec.name,
                argv=tuple(spec.command()),
                log_file=spec.log_file,
                env=spec.environment(),
                append_log=True,
                ready_url=f"{spec.url}/health",
                ready_timeout_s=DEFAULT_STARTUP_TIMEOUT_S,
                grace_s=STOP_GRACE_S,
                private_tmp=True,
                shm_prefixes=VLLM_SHM_PREFIXES,
            )
        )
        self.spec = spec

    @property
    def url(self) -> str:
        return self.spec.url

    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """All samples from ``/metrics``, summed over labels."""
        try:
            response = httpx.get(f"{self.url}/metrics", timeout=httpx.Timeout(timeout_s))
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise VllmServerError(f"{self.spec.name}: /metrics failed: {exc}") from exc
        return read_metrics_text(response.text)

    def load(self) -> EngineLoad:
        """Running and waiting request counts and KV-cache usage (0..1) from ``/metrics``."""
        values = self.metrics()
        return EngineLoad(
            running=values.get("vllm:num_requests_running", 0.0),
            waiting=values.get("vllm:num_requests_waiting", 0.0),
            kv_cache_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        )


def start_servers(
    specs: Sequence[VllmServerSpec], timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> list[VllmServer]:
    """Start all ``specs`` at once and wait until every one is healthy.

    On any failure (including KeyboardInterrupt) every server started here is stopped before the
    exception propagates.
    """
    servers = [VllmServer(spec) for spec in specs]
    start_all(servers, timeout_s)
    return servers


def stop_servers(servers: Sequence[VllmServer]) -> None:
    """Stop servers in reverse order; each stop is independent of the others' failures."""
    stop_all(servers)
