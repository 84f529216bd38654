"""disagg-router: OpenAI-compatible push-mode prefill/decode router for vLLM.

The public API is what this module exports; every other module of the package is internal and
may change without notice.

- :func:`create_app` builds the ASGI app from :class:`RouterSettings`;
- :func:`load_config` reads and validates the YAML routing-policy file (:class:`ConfigError`
  names the offending field);
- :func:`main` is the ``disagg-router`` console script (``serve``, ``check-config``).

Names are resolved on first use, so importing one internal module (the connector's contract
tests import ``disagg_router.router.upstream.rewrite``) does not load the whole server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg_router.router.cli import main
    from disagg_router.router.config import RouterSettings, load_config
    from disagg_router.router.errors import ConfigError
    from disagg_router.router.http.app import create_app

__all__ = ["ConfigError", "RouterSettings", "create_app", "load_config", "main"]
__version__ = "0.1.0"

_HOMES = {
    "create_app": "disagg_router.router.http.app",
    "main": "disagg_router.router.cli",
    "RouterSettings": "disagg_router.router.config",
    "load_config": "disagg_router.router.config",
    "ConfigError": "disagg_router.router.errors",
}


def __getattr__(name: str) -> Any:
    """The public names, imported from their modules on first access."""
    try:
        home = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'disagg_router.router' has no attribute {name!r}") from None
    return getattr(importlib.import_module(home), name)
