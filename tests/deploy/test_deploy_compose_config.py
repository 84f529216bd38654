"""deploy/compose: the 1P1D compose file is well formed and wired consistently (no engine).

Checks the CPU and GPU profiles: the services each profile starts, health-gated startup, P/D
pinning, the KV connector configs (our class, producer/consumer, a side channel D can reach), the
router config the router service generates (validated by the router's own config model), and, where
docker-compose is installed, that ``docker-compose config`` accepts the file for both profiles.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from disagg_router import connector
from disagg_router.router.config import RouterSettings, settings_from_mapping
from tests.deploy.deploy_support import (
    COMPOSE_FILE,
    command_flag,
    compose_services,
    kv_transfer_config,
    load_compose,
    require_tool,
)

PROFILES = {
    "cpu": {"prefill": "prefill", "decode": "decode", "router": "router"},
    "gpu": {"prefill": "prefill-gpu", "decode": "decode-gpu", "router": "router-gpu"},
}


def _router_settings(router: dict[str, object], served_model: str) -> RouterSettings:
    """The YAML the router service writes at start (a heredoc in its command), validated."""
    command = router["command"]
    assert isinstance(command, list) and len(command) == 1
    match = re.search(r"<<EOF\n(.*?)\nEOF\n", command[0], re.S)
    assert match, "router command must write its config with a heredoc"
    # Compose turns "$$" into "$"; the shell then expands $SERVED_MODEL from the environment.
    text = match.group(1).replace("$$", "$").replace("$SERVED_MODEL", served_model)
    assert "$" not in text, "unexpanded variable left in the router config"
    assert "--config /tmp/router.yaml" in command[0]
    return settings_from_mapping(yaml.safe_load(text))


def _defaults(value: str) -> str:
    """``value`` as compose interpolates it with no variables set: ``${VAR:-x}`` becomes ``x``."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _served_model(command: list[str]) -> str:
    served = [a.split("=", 1)[1] for a in command if a.startswith("--served-model-name=")]
    # `vllm serve MODEL ...` serves MODEL under its own name by default.
    return _defaults(served[0] if served else command[2])


def _hostnames(service_name: str, service: dict[str, object]) -> set[str]:
    """Names under which other containers on the default network reach ``service``."""
    names = {service_name}
    networks = service.get("networks")
    if isinstance(networks, dict):
        for net in networks.values():
            if isinstance(net, dict):
                names.update(net.get("aliases", []))
    return names


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_has_p_d_and_health_gated_router(profile: str) -> None:
    services = compose_services(profile)
    names = PROFILES[profile]
    assert {names["prefill"], names["decode"], names["router"]} <= set(services)
    router = services[names["router"]]
    for role in ("prefill", "decode"):
        assert router["depends_on"][names[role]] == {"condition": "service_healthy"}
        assert "/health" in " ".join(services[names[role]]["healthcheck"]["test"])
    assert "/ready" in " ".join(router["healthcheck"]["test"])
    # The router's port is published, on loopback by default.
    assert router["ports"] == ["${ROUTER_BIND:-127.0.0.1}:${ROUTER_PORT:-8000}:8000"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_connector_configs_match_our_connector(profile: str) -> None:
    services = compose_services(profile)
    names = PROFILES[profile]
    prefill = kv_transfer_config(services[names["prefill"]]["command"])
    decode = kv_transfer_config(services[names["decode"]]["command"])
    for config, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        assert config["kv_connector"] == connector.CONNECTOR_CLASS_NAME
        assert config["kv_connector_module_path"] == connector.CONNECTOR_MODULE_PATH
        assert config["kv_role"] == role
        assert config["kv_buffer_device"] == ("cpu" if profile == "cpu" else "cuda")
    # P's side channel must listen on a name D can resolve on the compose network.
    side_host = prefill["kv_connector_extra_config"]["side_channel_host"]
    assert side_host in _hostnames(names["prefill"], services[names["prefill"]])


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_router_config_is_valid_and_points_at_p_and_d(profile: str) -> None:
    services = compose_services(profile)
    names = PROFILES[profile]
    served = _served_model(services[names["prefill"]]["command"])
    assert served == _served_model(services[names["decode"]]["command"])
    env_model = _defaults(services[names["router"]]["environment"]["SERVED_MODEL"])
    settings = _router_settings(services[names["router"]], env_model)
    assert settings.models == [served]
    assert settings.mode == "push"
    for role, pool in (("prefill", settings.prefill), ("decode", settings.decode)):
        hosts = _hostnames(names[role], services[names[role]])
        assert [i.url for i in pool.instances] == [f"http://{role}:8000"]
        assert role in hosts
        assert command_flag(services[names[role]]["command"], "--port") == "8000"


def test_cpu_profile_pins_p_and_d_to_separate_cores_and_makes_the_model() -> None:
    services = compose_services("cpu")
    p, d = services["prefill"], services["decode"]
    assert (p["cpuset"], d["cpuset"]) == ("0", "1")
    assert p["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == p["cpuset"]
    assert d["environment"]["VLLM_CPU_OMP_THREADS_BIND"] == d["cpuset"]
    for svc in (p, d):
        assert svc["depends_on"]["model-init"] == {"condition": "service_completed_successfully"}
        assert command_flag(svc["command"], "--load-format") == "dummy"
        assert command_flag(svc["command"], "--model") == "/models/tiny"
    assert "make_tiny_model(Path('/models/tiny'))" in services["model-init"]["command"][0]


def test_gpu_profile_requests_separate_gpus_by_default() -> None:
    services = compose_services("gpu")
    ids = []
    for name in ("prefill-gpu", "decode-gpu"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        ids.append(device["device_ids"])
        assert services[name]["command"][2] == "${MODEL:-Qwen/Qwen3-0.6B}"
    assert ids == [["${PREFILL_GPU:-0}"], ["${DECODE_GPU:-1}"]]


def test_compose_file_declares_the_model_volume() -> None:
    assert "models" in load_compose()["volumes"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_docker_compose_config_accepts_the_file(profile: str) -> None:
    """The real compose implementation parses, interpolates and validates the file."""
    tool = require_tool("docker-compose")
    env = {**os.environ, "COMPOSE_PROFILES": profile, "MODEL": "org/some-model"}
    result = subprocess.run(
        [tool, "-f", str(COMPOSE_FILE), "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    names = PROFILES[profile]
    assert {names["prefill"], names["decode"], names["router"]} <= set(rendered["services"])
    if profile == "gpu":  # interpolation happened: MODEL reaches both engines and the router
        assert rendered["services"]["prefill-gpu"]["command"][2] == "org/some-model"
        assert rendered["services"]["router-gpu"]["environment"]["SERVED_MODEL"] == (
            "org/some-model"
        )


def test_docker_compose_config_rejects_a_broken_file(tmp_path: Path) -> None:
    """Control: the config check above can fail (a service with an unknown key)."""
    tool = require_tool("docker-compose")
    broken = load_compose()
    broken["services"]["router"]["not_a_compose_key"] = 1
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run(
        [tool, "-f", str(path), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
