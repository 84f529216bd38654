"""``--kv-transfer-config`` dictionaries for the KV connectors we run against.

Who calls it: :mod:`devstack.stack`, fixtures, the demo, benchmarks and deploy scripts.

Kinds:
- ``"vllm-push"``: vLLM's built-in ``NixlPushConnector`` (D registers blocks, P WRITEs);
- ``"vllm-pull"``: vLLM's ``NixlConnector`` (P keeps blocks, D READs them);
- ``"ours"``: this project's connector in the ``connector`` package (imported lazily, so this
  module works even before the connector exists).

Roles: ``"prefill"`` -> ``kv_producer``, ``"decode"`` -> ``kv_consumer``, ``"both"`` -> ``kv_both``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

ConnectorKind = Literal["vllm-push", "vllm-pull", "ours"]
Role = Literal["prefill", "decode", "both"]

CONNECTOR_KINDS: tuple[ConnectorKind, ...] = ("vllm-push", "vllm-pull", "ours")
PUSH_KINDS: frozenset[str] = frozenset({"vllm-push", "ours"})

_KV_ROLES: dict[str, str] = {
    "prefill": "kv_producer",
    "decode": "kv_consumer",
    "both": "kv_both",
}
_VLLM_CLASSES: dict[str, str] = {
    "vllm-push": "NixlPushConnector",
    "vllm-pull": "NixlConnector",
}


def router_mode(kind: str) -> Literal["push", "pull"]:
    """The router mode that matches a connector kind."""
    if kind not in CONNECTOR_KINDS:
        raise ValueError(f"unknown connector kind {kind!r}; expected one of {CONNECTOR_KINDS}")
    return "push" if kind in PUSH_KINDS else "pull"


def _our_connector_names() -> tuple[str, str]:
    from disagg_router import connector

    return connector.CONNECTOR_CLASS_NAME, connector.CONNECTOR_MODULE_PATH


def kv_transfer_config(
    kind: str, role: str, extra_config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` dict for ``kind`` in ``role``.

    ``extra_config`` becomes ``kv_connector_extra_config`` (e.g. ``push_registration_timeout``).
    Raises ``ValueError`` for an unknown kind or role.
    """
    if role not in _KV_ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {tuple(_KV_ROLES)}")
    if kind in _VLLM_CLASSES:
        config: dict[str, Any] = {"kv_connector": _VLLM_CLASSES[kind]}
    elif kind == "ours":
        class_name, module_path = _our_connector_names()
        config = {"kv_connector": class_name, "kv_connector_module_path": module_path}
    else:
        raise ValueError(f"unknown connector kind {kind!r}; expected one of {CONNECTOR_KINDS}")
    config["kv_role"] = _KV_ROLES[role]
    config["kv_buffer_device"] = "cpu"
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    return config
