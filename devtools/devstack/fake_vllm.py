"""A fake vLLM OpenAI server that behaves, as far as the router can see, like vLLM in P/D mode.

Who uses it: the router's integration tests, the e2e support code, the bench client's tests
(scripted token timings) and the bench (router-overhead runs with zero delays). This module is
the stable import path; the pieces live in :mod:`devstack.fakes` (``state``: knobs and records,
``vllm_app``: the app, ``server``: uvicorn in a thread). ``python -m devstack.fake_vllm --port N``
serves one fake until interrupted.

It serves ``/v1/completions`` and ``/v1/chat/completions`` (SSE stream and JSON), ``/v1/models``,
``/health`` and ``/metrics`` (running/waiting gauges named like vLLM's). Every request is recorded
(path, headers, body, outcome), and in-flight / cancelled counts prove that the router cancels
upstream legs. It does no inference and binds loopback only.
"""

from __future__ import annotations

import argparse

import uvicorn

from devstack.fakes.server import FakeVllmServer, UvicornThread, fake_vllm
from devstack.fakes.state import (
    FakeBehavior,
    FakeVllmState,
    KvFabric,
    PushIdentity,
    RecordedRequest,
    TokenScript,
    identity_copy,
)
from devstack.fakes.vllm_app import create_fake_app

__all__ = [
    "FakeBehavior",
    "FakeVllmServer",
    "FakeVllmState",
    "KvFabric",
    "PushIdentity",
    "RecordedRequest",
    "TokenScript",
    "UvicornThread",
    "create_fake_app",
    "fake_vllm",
    "identity_copy",
    "main",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m devstack.fake_vllm --port N``: serve one fake until interrupted."""
    parser = argparse.ArgumentParser(description="fake vLLM OpenAI server (P/D aware)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--prefill-delay", type=float, default=0.0)
    parser.add_argument(
        "--prefill-slots", type=int, default=None, help="concurrent prefills (others queue)"
    )
    args = parser.parse_args(argv)
    identity = PushIdentity(engine_id=args.engine_id) if args.engine_id else PushIdentity()
    state = FakeVllmState(
        model=args.model,
        behavior=FakeBehavior(
            prefill_delay_s=args.prefill_delay,
            token_delay_s=args.token_delay,
            prefill_slots=args.prefill_slots,
        ),
        identity=identity,
    )
    uvicorn.run(
        create_fake_app(state),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
