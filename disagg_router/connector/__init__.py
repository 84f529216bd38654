"""Our NIXL push KV connector for vLLM (loaded with ``kv_connector_module_path``).

vLLM loads the connector with::

    --kv-transfer-config '{"kv_connector": "DisaggPushConnector",
                           "kv_connector_module_path": "disagg_router.connector", "kv_role": ...}'

The class name is deliberately *not* one of vLLM's registered names nor any name vLLM
dispatches on (``has_connector("NixlConnector")`` in ``config/vllm.py``, the NIXL list in
``platforms/cpu.py``, the factory registry), so vLLM applies none of its NIXL-specific
special cases to us and never silently picks its own class instead of ours.

Importing this package is cheap: the facade (which imports vLLM and torch) is only loaded
when the class attribute is first accessed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

CONNECTOR_CLASS_NAME = "DisaggPushConnector"
"""The ``kv_connector`` value to put into vLLM's ``--kv-transfer-config``."""

CONNECTOR_MODULE_PATH = "disagg_router.connector"
"""The ``kv_connector_module_path`` value to put into vLLM's ``--kv-transfer-config``."""

if TYPE_CHECKING:
    from disagg_router.connector.facade import DisaggPushConnector

__all__ = ["CONNECTOR_CLASS_NAME", "CONNECTOR_MODULE_PATH", "DisaggPushConnector"]


def __getattr__(name: str) -> Any:
    """Load the vLLM-facing facade lazily (vLLM's factory does ``getattr(module, name)``)."""
    if name == CONNECTOR_CLASS_NAME:
        from disagg_router.connector.facade import DisaggPushConnector

        return DisaggPushConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
