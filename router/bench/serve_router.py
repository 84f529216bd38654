"""Run our router as its own process for benchmarks: ``python -m router.bench.serve_router``.

A thin adapter over the router's public API (``router.config.load_config`` and
``router.app.create_app``), so the benchmarks do not depend on the serve command's flags. It binds
loopback only and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

import uvicorn


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="serve disagg-router from a YAML config")
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    config_mod = importlib.import_module("router.config")
    app_mod = importlib.import_module("router.app")
    settings = config_mod.load_config(args.config)
    app: Any = app_mod.create_app(settings)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
