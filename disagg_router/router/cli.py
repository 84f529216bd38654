"""``disagg-router`` console script: ``serve``, ``check-config`` and ``hash-key``.

``serve --workers N`` (N > 1) runs N router processes on one listening socket
(:mod:`disagg_router.router.workers`); each worker loads the config file itself and drains on
SIGTERM as ``serve`` does. What that means for per-process state: docs/router.md, "Several workers".

The development tools (``disagg-demo``, ``disagg-bench``) are console scripts of the separate
``disagg-router-devtools`` distribution (``devtools/``); the server knows nothing of them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from disagg_router.connector.contract import EngineShape, pairing_refusal
from disagg_router.router.config import (
    DisaggregationConfig,
    PoolConfig,
    RouterSettings,
    ShapeConfig,
)
from disagg_router.router.errors import ConfigError


def _cmd_check_config(args: argparse.Namespace) -> int:
    from disagg_router.router.config import load_config

    try:
        settings = load_config(
            args.file, on_deprecated=lambda m: print(f"warning: {m}", file=sys.stderr)
        )
    except ConfigError as exc:
        print(f"invalid config {args.file}: {exc.message}", file=sys.stderr)
        return 1
    refused = [line for line in shape_report(settings) if line.startswith("refused")]
    if refused:
        print("\n".join(f"invalid config {args.file}: {line}" for line in refused), file=sys.stderr)
        return 1
    print(f"ok: {args.file}: mode={settings.mode} models={','.join(settings.model_names)}")
    print(effective_table(settings))
    print("\n".join(shape_report(settings)))
    return 0


def _engine_shape(shape: ShapeConfig) -> EngineShape:
    return EngineShape(shape.tp_size, shape.pp_size, shape.block_size, shape.num_kv_heads)


def shape_report(settings: RouterSettings) -> list[str]:
    """One line a model: its declared P/D shapes served, ``refused: ...`` with the connector's
    reason, or learned at run time (a pool declares no ``shape``)."""
    lines = []
    for name, route in settings.routes().items():
        p, d = route.prefill.shape, route.decode.shape
        if p is None or d is None:
            lines.append(f"shapes of {name}: learned at run time (identity probes)")
            continue
        why = pairing_refusal(_engine_shape(p), _engine_shape(d))
        verdict = "served" if why is None else f"refused by the KV connector: {why}"
        lines.append(f"{'refused: ' if why else ''}shapes of {name}: declared, {verdict}")
    return lines


def _pool_cell(pool: PoolConfig) -> str:
    """``2 x round_robin`` for a listed pool, ``dns x least_in_flight`` for a discovered one."""
    source = pool.discovery.source
    return f"{len(pool.instances) if source == 'static' else source} x {pool.policy}"


def _rule_cell(rule: DisaggregationConfig) -> str:
    short = (
        f"D alone below {rule.min_prompt_tokens} tokens" if rule.min_prompt_tokens else "always P+D"
    )
    return f"{short}; no usable P: {rule.when_no_prefill.replace('_', ' ')}"


def effective_table(settings: RouterSettings) -> str:
    """The effective per-model table: pools, policies, disaggregation rule (one row a model)."""
    rows = [("model", "prefill", "decode", "disaggregation")]
    for name, route in settings.routes().items():
        rows.append(
            (
                name,
                _pool_cell(route.prefill),
                _pool_cell(route.decode),
                _rule_cell(route.disaggregation),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
        for r in rows
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from disagg_router.router.config import load_config
    from disagg_router.router.observability.reqlog import configure_logging
    from disagg_router.router.server import serve

    deprecated: list[str] = []
    try:
        settings = load_config(args.config, on_deprecated=deprecated.append)
    except ConfigError as exc:
        print(f"invalid config {args.config}: {exc.message}", file=sys.stderr)
        return 1
    configure_logging(settings.logging, args.log_level)
    for message in deprecated:  # logged once logging speaks the configured format
        logging.getLogger("disagg_router.router.config").warning("%s", message)
    if args.workers == 1:
        serve(settings, args.host, args.port, args.log_level, config_path=Path(args.config))
        return 0
    from disagg_router.router.workers import run_workers

    return run_workers(Path(args.config), args.host, args.port, args.log_level, args.workers)


def _cmd_hash_key(args: argparse.Namespace) -> int:
    """Print the SHA-256 digest a tenant's ``key_sha256`` lists, of the key read from stdin
    (one line; never from the command line, where other users and shell history see it)."""
    from disagg_router.router.tenants import hash_key

    key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        print(
            'hash-key: no key on stdin (echo -n "$KEY" | disagg-router hash-key)', file=sys.stderr
        )
        return 2
    print(hash_key(key))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="router processes sharing the port (default 1); each keeps its own in-flight "
        "counts, health, breaker and policy state; /metrics shows all workers summed "
        "(docs/router.md, 'Several workers')",
    )

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file")

    sub.add_parser("hash-key", help="print the key_sha256 of the API key read from stdin (tenancy)")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``disagg-router`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "hash-key":
        return _cmd_hash_key(args)
    return _cmd_check_config(args)


if __name__ == "__main__":
    raise SystemExit(main())
