"""README.md's "In front of your own vLLM instances" examples are valid as written.

The router config block (```yaml starting with ``# router.yaml``) validates as a router config,
and every ``--kv-transfer-config`` of the ``vllm serve`` block is JSON that loads our connector
(class name and module path as the connector exports them) with a valid extra config, one
``kv_producer`` (P) and one ``kv_consumer`` (D).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from disagg_router import connector
from disagg_router.connector.config import ConnectorConfig
from disagg_router.router.config import settings_from_mapping

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(lang: str, first_line_pattern: str) -> str:
    text = README.read_text()
    match = re.search(rf"```{lang}\n({first_line_pattern}.*?)```", text, re.DOTALL)
    assert match, f"README.md has no ```{lang} block starting with {first_line_pattern!r}"
    return match.group(1)


def test_router_config_example_is_valid() -> None:
    settings = settings_from_mapping(yaml.safe_load(_block("yaml", r"# router\.yaml\n")))
    assert settings.mode == "push"


def _kv_transfer_configs() -> list[dict[str, Any]]:
    block = _block("bash", r"vllm serve ")
    raw = re.findall(r"--kv-transfer-config '([^']*)'", block)
    return [json.loads(text) for text in raw]


def test_vllm_flags_load_our_connector_for_p_and_d() -> None:
    configs = _kv_transfer_configs()
    assert sorted(c["kv_role"] for c in configs) == ["kv_consumer", "kv_producer"]
    for config in configs:
        assert config["kv_connector"] == connector.CONNECTOR_CLASS_NAME
        assert config["kv_connector_module_path"] == connector.CONNECTOR_MODULE_PATH
        ConnectorConfig.from_extra_config(config.get("kv_connector_extra_config", {}))
