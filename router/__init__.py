"""disagg-router: OpenAI-compatible push-mode prefill/decode router for vLLM.

The public API is what this module exports; every other module of the package is internal and
may change without notice.

- :func:`create_app` builds the ASGI app from :class:`RouterSettings` (``transport=`` injects an
  httpx transport for tests);
- :func:`load_config` reads and validates the YAML routing-policy file (:class:`ConfigError`
  names the offending field);
- :func:`main` is the ``disagg-router`` console script (``serve``, ``check-config``).
"""

from router.app import create_app
from router.cli import main
from router.config import RouterSettings, load_config
from router.errors import ConfigError

__all__ = ["ConfigError", "RouterSettings", "create_app", "load_config", "main"]
__version__ = "0.1.0"
