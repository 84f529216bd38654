"""Start, health-check, inspect and stop real vLLM CPU OpenAI servers.

Who calls it: e2e fixtures, the demo, benchmarks and :mod:`devstack.stack`. The caller owns
the :class:`VllmServer` and must call :meth:`VllmServer.stop` (or use it as a context manager).

Contract:
- each server runs ``python -m vllm.entrypoints.openai.api_server`` as a
  :class:`~devstack.process.ChildProcess` (own process group, parent-death signal, log
  file), with its OpenMP threads pinned to one CPU core and its NIXL side channel on the given
  port;
- :meth:`VllmServer.wait_ready` polls ``/health`` and fails fast, with the log tail, if the process
  exits; :meth:`VllmServer.stop` sends SIGTERM to the whole group (API server and engine core),
  then SIGKILL, and leaves no orphans;
- the model worker runs inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  which keeps vLLM's CPU platform on its in-process executor) unless ``in_process_worker`` is
  off: with one worker the separate worker process only adds a shared-memory queue that both
  sides busy-poll for 1 s after every message, costly on a 2-core machine, and with vLLM 0.32's
  ``NixlPushConnector`` that queue deadlocked P here (docs/notes/vllm-facts.md);
- :func:`start_servers` launches several servers at once (startup takes ~90 s each) and waits for
  all of them; if any fails, all are stopped.

:meth:`VllmServer.start` must be called from a long-lived thread (see
:mod:`devstack.process`): the parent-death signal fires when the launching thread exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.ports import LOOPBACK
from devstack.process import ChildProcess, ProcessSpec, read_log_tail

DEFAULT_STARTUP_TIMEOUT_S = 300.0


class VllmServerError(RuntimeError):
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
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()

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
        argv += list(self.extra_args)
        return argv

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process environment: ``base`` (default: ours) plus the pinning/offline settings."""
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu_core),
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


class VllmServer:
    """One running (or starting) vLLM server process."""

    def __init__(self, spec: VllmServerSpec) -> None:
        self.spec = spec
        self._child: ChildProcess | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def log_path(self) -> Path:
        return self.spec.log_file

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def start(self) -> None:
        """Launch the process (non-blocking). Call :meth:`wait_ready` next."""
        if self._child is not None:
            raise VllmServerError(f"{self.spec.name}: already started")
        process = ProcessSpec(
            name=self.spec.name,
            argv=tuple(self.spec.command()),
            log_file=self.spec.log_file,
            env=self.spec.environment(),
            append_log=True,
        )
        self._child = ChildProcess(process).start()

    def is_alive(self) -> bool:
        return self._child is not None and self._child.is_alive()

    def log_tail(self, lines: int = 40) -> str:
        return read_log_tail(self.spec.log_file, lines)

    def check_ready_once(self, client: httpx.Client) -> bool:
        """One health poll; raises :class:`VllmServerError` if the process has exited."""
        if self._child is None:
            raise VllmServerError(f"{self.spec.name}: not started")
        code = self._child.poll()
        if code is not None:
            raise VllmServerError(
                f"{self.spec.name} exited with code {code} during startup; "
                f"log {self.spec.log_file}:\n{self.log_tail()}"
            )
        try:
            return client.get(f"{self.url}/health").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Block until ``/health`` answers 200; raise with the log tail on death or timeout."""
        wait_all_ready([self], timeout_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group (API server and engine core), SIGKILL whatever is left after
        ``grace_s``. Idempotent."""
        if self._child is not None:
            self._child.stop(grace_s)

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

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_all_ready(servers: Sequence[VllmServer], timeout_s: float) -> None:
    """Poll every server's ``/health`` until all answer; raise on the first death or on timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
        while pending:
            pending = [server for server in pending if not server.check_ready_once(client)]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(server.spec.name for server in pending)
                tails = "\n".join(f"--- {s.spec.name}:\n{s.log_tail()}" for s in pending)
                raise VllmServerError(f"not ready after {timeout_s:.0f}s: {names}\n{tails}")
            time.sleep(0.5)


def start_servers(
    specs: Sequence[VllmServerSpec], timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
) -> list[VllmServer]:
    """Start all ``specs`` at once and wait until every one is healthy.

    On any failure (including KeyboardInterrupt) every server started here is stopped before the
    exception propagates.
    """
    servers = [VllmServer(spec) for spec in specs]
    try:
        for server in servers:
            server.start()
        wait_all_ready(servers, timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Sequence[VllmServer]) -> None:
    """Stop servers in reverse order; each stop is independent of the others' failures."""
    for server in reversed(servers):
        server.stop()
