"""The engines in deploy/ set exactly what our connector reads, and nothing it ignores.

For the compose GPU and CPU profiles and the Kubernetes base (overlays change only replica
counts): every ``--kv-transfer-config`` key is one the connector reads, every
``kv_connector_extra_config`` key is read by that engine's side (P or D), ``kv_buffer_device``
says where the KV cache is (``cuda`` on GPUs), no side-channel environment variable is shadowed
by the extra config or set on D (which has no side channel), and no engine asks for tensor or
pipeline parallelism (each engine gets one device; a user raising the parallel size must raise
the engine's devices with it, deploy/README.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg_router.connector.config import KV_TRANSFER_CONFIG_KEYS, ConnectorConfig
from tests.deploy.deploy_support import K8S, compose_services, kv_transfer_config

SIDE_CHANNEL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")
PARALLEL_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "-tp", "-pp")
Engine = tuple[str, list[str], dict[str, Any]]  # (P or D, argv, environment)


def _compose_engines(profile: str) -> list[Engine]:
    services = compose_services(profile)
    suffix = "" if profile == "cpu" else "-gpu"
    out = []
    for side, name in (("P", "prefill"), ("D", "decode")):
        svc = services[name + suffix]
        out.append((side, svc["command"], dict(svc.get("environment") or {})))
    return out


def _k8s_engines() -> list[Engine]:
    out = []
    for side, file in (("P", "prefill.yaml"), ("D", "decode.yaml")):
        docs = list(yaml.safe_load_all(Path(K8S / "base" / file).read_text()))
        (workload,) = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
        out.append((side, container["args"], env))
    return out


ENGINES = {
    "compose-cpu": (_compose_engines("cpu"), "cpu"),
    "compose-gpu": (_compose_engines("gpu"), "cuda"),
    "k8s": (_k8s_engines(), "cuda"),
}


@pytest.mark.parametrize("where", sorted(ENGINES))
def test_engines_set_only_what_the_connector_reads(where: str) -> None:
    engines, buffer_device = ENGINES[where]
    for side, argv, env in engines:
        kv = kv_transfer_config(argv)
        unread = set(kv) - KV_TRANSFER_CONFIG_KEYS
        assert not unread, f"{where} {side}: {unread}"
        assert kv["kv_role"] == ("kv_producer" if side == "P" else "kv_consumer")
        assert kv["kv_buffer_device"] == buffer_device
        extra = kv.get("kv_connector_extra_config", {})
        for key in extra:
            assert ConnectorConfig.read_by(key) in (side, "both"), f"{where} {side} sets {key}"
        shadowed = [v for v in SIDE_CHANNEL_ENV if v in env]
        assert not shadowed, f"{where} {side}: {shadowed} (extra config or no side channel)"
        assert not [
            a for a in argv if a.split("=")[0] in PARALLEL_FLAGS and a.split("=")[-1] != "1"
        ]
