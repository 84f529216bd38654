"""``disagg-bench run``: one load-generator run against an OpenAI endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.client import Target
from bench.dataset import BenchRequest, SyntheticSpec, make_text_prompts, make_token_prompts
from bench.loadgen import LoadSpec, make_client, run_load
from bench.results import result_to_dict, write_json


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench run`` (names follow ``vllm bench serve`` where one exists)."""
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:18300")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=1024, help="total prompt tokens")
    parser.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="ids: prompt token ids (exact); text: needs --tokenizer",
    )
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json or a model directory")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf=all)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--num-warmups", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentiles", default="50,90,99")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--save-records", action="store_true", help="per-request records in JSON")
    parser.add_argument("--result-file", type=Path, help="write JSON results here")
    parser.add_argument("--no-progress", action="store_true")


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    return Tokenizer.from_file(str(file))


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset the flags describe; raises ``ValueError`` naming a bad flag."""
    vocab_size = args.vocab_size
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    if tokenizer is not None:
        vocab_size = int(tokenizer.get_vocab_size())
    spec = SyntheticSpec(
        num_requests=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        vocab_size=vocab_size,
        seed=args.seed,
    )
    if args.prompt_format == "ids":
        return make_token_prompts(spec)
    if tokenizer is None:
        raise ValueError("--tokenizer is required with --prompt-format text")
    return make_text_prompts(
        spec,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as JSON-ready values."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if isinstance(v, (str, int, float, bool, Path, type(None)))
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    requests = build_requests(args)
    target = Target(args.base_url.rstrip("/"), args.model, args.endpoint)
    spec = LoadSpec(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        seed=args.seed,
        percentiles=tuple(float(p) for p in args.percentiles.split(",")),
        show_progress=not args.no_progress,
    )
    async with make_client(request_timeout_s=args.request_timeout) as client:
        result = await run_load(client, target, requests, spec)
    return result_to_dict(result, settings_of(args), include_records=args.save_records)


def run_command(args: argparse.Namespace) -> int:
    """Run, print the metrics JSON on stdout, optionally write the result file."""
    try:
        data = asyncio.run(_run(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.result_file:
        write_json(args.result_file, data)
    print(json.dumps(data["metrics"], indent=2))
    return 0 if data["metrics"]["failed"] == 0 else 1
