"""disagg-router: OpenAI-compatible push-mode prefill/decode router for vLLM.

The public API is what this module exports; every other module of the package is internal and
may change without notice.

- :func:`create_app` builds the ASGI app from :class:`RouterSettings`;
- :func:`load_config` reads and validates the YAML routing-policy file (:class:`ConfigError`
  names the offending field);
- :func:`main` is the ``disagg-router`` console script (``serve``, ``check-config``).

Names are resolved on first use, so importing one internal module (the connector's contract
tests import ``router.upstream.rewrite``) does not load the whole server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.cli import main
    from router.config import RouterSettings, load_config
    from router.errors import ConfigError
    from router.http.app import create_app

__all__ = ["ConfigError", "RouterSettings", "create_app", "load_config", "main"]
__version__ = "0.1.0"

_HOMES = {
    "create_app": "router.http.app",
    "main": "router.cli",
    "RouterSettings": "router.config",
    "load_config": "router.config",
    "ConfigError": "router.errors",
}


def __getattr__(name: str) -> Any:
    """The public names, imported from their modules on first access."""
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'router' has no attribute {name!r}") from None
    return getattr(importlib.import_module(home), name)
