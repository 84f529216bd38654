"""``disagg-router`` console script: ``serve`` and ``check-config``.

The development tools (``disagg-demo``, ``disagg-bench``) are console scripts of the separate
``disagg-router-devtools`` distribution (``devtools/``); the server knows nothing of them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from router.errors import ConfigError


def _cmd_check_config(args: argparse.Namespace) -> int:
    from router.config import load_config

    try:
        settings = load_config(args.file)
    except ConfigError as exc:
        print(f"invalid config {args.file}: {exc.message}", file=sys.stderr)
        return 1
    n_p, n_d = len(settings.prefill.instances), len(settings.decode.instances)
    print(
        f"ok: {args.file}: mode={settings.mode} models={','.join(settings.models)} "
        f"prefill={n_p} ({settings.prefill.policy}) decode={n_d} ({settings.decode.policy})"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import create_app
    from router.config import load_config

    try:
        settings = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid config {args.config}: {exc.message}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``disagg-router`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="disagg-router", description="Disaggregated prefill/decode router for vLLM"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``disagg-router`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    return _cmd_check_config(args)


if __name__ == "__main__":
    raise SystemExit(main())
