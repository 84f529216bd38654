"""Launchers for the routers under test: ours (``disagg-router serve``), ``vllm-router`` and
the floor proxy (:mod:`bench.floor_router`).

Who calls it: the overhead benchmark and the scenario runner. Each returns an unstarted
:class:`~devstack.process.ChildProcess` with a readiness URL; the caller starts and stops it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from devstack.ports import free_port
from devstack.process import ChildProcess, http_process


def _python() -> str:
    return sys.executable


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """``argv`` run on the CPUs ``cpus`` (``taskset -c`` list, e.g. "1"); as is if ``None``."""
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def router_config(
    model: str,
    prefill_url: str,
    decode_url: str,
    mode: str = "push",
    identity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Our router's YAML config for one P and one D.

    Without ``identity`` the router probes P for its push identity itself (push mode).
    """
    prefill: dict[str, Any] = {"url": prefill_url}
    if identity is not None:
        prefill["identity"] = identity
    return {
        "models": [model],
        "mode": mode,
        "prefill": {"instances": [prefill]},
        "decode": {"instances": [{"url": decode_url}]},
        "health": {"interval": 2.0},
    }


def router_module(source: Path | None) -> str:
    """The router's command module in ``source`` (a checkout; None: the installed router): a
    checkout from before the one top-level package holds ``router/cli.py`` at its root."""
    if source is not None and (source / "router" / "cli.py").is_file():
        return "router.cli"
    return "disagg_router.router.cli"


def leg_timeouts(seconds: float, **more: float) -> dict[str, float]:
    """Our router's ``timeouts`` for instances slower than its defaults allow for (vLLM CPU
    under load): ``seconds`` for P's leg, D's first token and D after P, plus ``more``
    (``total``, ``health``); the rest at the router's defaults."""
    return {"prefill": seconds, "first_token": seconds, "after_prefill": seconds, **more}


def router_config_path(logs: Path, port: int) -> Path:
    """Where :func:`our_router` writes the config of the router on ``port`` (a benchmark that
    changes it rewrites this file and sends SIGHUP)."""
    return logs / f"router-{port}.yaml"


def our_router(
    config: dict[str, Any],
    port: int,
    logs: Path,
    ready_timeout_s: float = 60.0,
    cpus: str | None = None,
    workers: int = 1,
    source: Path | None = None,
    log_level: str = "warning",
) -> ChildProcess:
    """Our router as a process (``disagg-router serve``, ``--workers`` when more than one),
    ready once both pools are usable; pinned to ``cpus`` when given. ``source``: another
    checkout whose ``router`` package runs instead of the installed one (put first on
    ``PYTHONPATH``; its dependencies are this environment's). ``log_level``: ``info`` logs a
    summary line per request."""
    path = router_config_path(logs, port)
    path.write_text(yaml.safe_dump(config))
    # -P: the working directory is not put first on sys.path, so a checkout it holds cannot
    # stand in for the router meant (the installed one, or ``source``).
    argv = [_python(), "-P", "-m", router_module(source), "serve", "--config", str(path)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", log_level]
    if workers > 1:
        argv += ["--workers", str(workers)]
    argv = pinned(argv, cpus)
    ready = f"http://127.0.0.1:{port}/ready"
    log = logs / f"router-{port}.log"
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source.resolve())}
    return http_process("router", argv, ready, log, env=env, ready_timeout_s=ready_timeout_s)


def floor_router(
    prefill_url: str,
    decode_url: str,
    identity: dict[str, Any],
    port: int,
    logs: Path,
    cpus: str | None = None,
) -> ChildProcess:
    """The floor proxy (:mod:`bench.floor_router`) over one P and one D; pinned to ``cpus``."""
    argv = [_python(), "-m", "bench.floor_router", "--prefill", prefill_url, "--decode"]
    argv += [decode_url, "--identity", json.dumps(identity), "--port", str(port)]
    ready = f"http://127.0.0.1:{port}/health"
    return http_process("floor", pinned(argv, cpus), ready, logs / f"floor-{port}.log")


def vllm_router(
    prefill_url: str | Sequence[str],
    decode_url: str | Sequence[str],
    port: int,
    logs: Path,
    ready_timeout_s: float = 60.0,
    cpus: str | None = None,
    extra_args: Sequence[str] = (),
) -> ChildProcess:
    """``vllm-router`` in vLLM P/D mode (NIXL pull protocol) over one or more P and D;
    pinned to ``cpus`` when given; ``extra_args`` last (e.g. ``--prefill-policy kv_aware``)."""
    exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    prefills = [prefill_url] if isinstance(prefill_url, str) else list(prefill_url)
    decodes = [decode_url] if isinstance(decode_url, str) else list(decode_url)
    argv = [
        exe,
        "--vllm-pd-disaggregation",
        *[arg for url in prefills for arg in ("--prefill", url)],  # one flag per P
        *[arg for url in decodes for arg in ("--decode", url)],  # one flag per D
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--kv-connector",
        "nixl",
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--queue-size",
        "4096",
        "--log-level",
        "warning",
        *extra_args,
    ]
    ready = f"http://127.0.0.1:{port}/health"
    log = logs / f"vllm-router-{port}.log"
    return http_process(
        "vllm-router", pinned(argv, cpus), ready, log, ready_timeout_s=ready_timeout_s
    )
