"""``disagg-router`` console script: ``serve``, ``check-config``, ``demo`` and ``bench``.

``demo`` and ``bench`` are owned by other modules (``router.devstack.demo``, ``router.bench.cli``),
imported lazily so the router itself never depends on them; each exposes
``add_arguments(parser)`` and ``run(args) -> int``. A missing module gives a clear message and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from router.errors import ConfigError

_PLUGINS = {
    "demo": ("router.devstack.demo", "run the 1P1D demo on real vLLM CPU instances"),
    "bench": ("router.bench.cli", "benchmarks (load generator, router overhead, ...)"),
}


def _load_plugin(name: str) -> ModuleType | None:
    module_name = _PLUGINS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise


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


def build_parser(plugin_command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; only ``plugin_command``'s module (if any) is imported."""
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

    for name, (_, help_text) in _PLUGINS.items():
        plugin_parser = sub.add_parser(name, help=help_text, add_help=False)
        plugin = _load_plugin(name) if name == plugin_command else None
        if plugin is not None:
            plugin_parser.add_argument("-h", "--help", action="help")
            plugin.add_arguments(plugin_parser)
        else:
            plugin_parser.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``disagg-router`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plugin_command = argv[0] if argv and argv[0] in _PLUGINS else None
    args = build_parser(plugin_command).parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "check-config":
        return _cmd_check_config(args)
    plugin = _load_plugin(args.command)
    if plugin is None:
        module_name = _PLUGINS[args.command][0]
        print(
            f"disagg-router {args.command}: {module_name} is not available in this checkout",
            file=sys.stderr,
        )
        return 2
    result: int = plugin.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
