"""Helpers shared by the deploy tests: paths, tool lookup, compose/k8s file access.

Who calls it: the modules in tests/deploy. Nothing here starts a container or touches the network.
Tools that a plain machine lacks (docker-compose, kubectl, kubernetes-validate) are looked up here;
``deploy/ci/install-tools.sh`` installs them. With ``DISAGG_DEPLOY_REQUIRE_TOOLS=1`` (set by CI
after installing them) a missing tool fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "disagg-router-dashboard.json"


def require_tool(name: str) -> str:
    """Path of executable ``name`` (the venv's bin first); skip, or fail when tools are required."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(name, path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        message = f"{name} is not installed (deploy/ci/install-tools.sh installs it)"
        if os.environ.get("DISAGG_DEPLOY_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def compose_services(profile: str) -> dict[str, dict[str, Any]]:
    """The services of ``deploy/compose/docker-compose.yml`` active in ``profile``."""
    services: dict[str, dict[str, Any]] = load_compose()["services"]
    return {name: svc for name, svc in services.items() if profile in svc.get("profiles", [])}


def command_flag(command: list[str], flag: str) -> str:
    """The value of ``--flag=value`` in an argv list; fails the test when absent."""
    prefix = f"{flag}="
    values = [arg[len(prefix) :] for arg in command if arg.startswith(prefix)]
    assert len(values) == 1, f"{flag} must appear once in {command}"
    return values[0]


def kv_transfer_config(command: list[str]) -> dict[str, Any]:
    config = json.loads(command_flag(command, "--kv-transfer-config"))
    assert isinstance(config, dict)
    return config
