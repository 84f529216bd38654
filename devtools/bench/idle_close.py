"""``python -m bench.idle_close``: the idle-close race on the router's upstream connections.

Who calls it: a person, for the fault matrix (docs/benchmarks/fault-matrix.md). An upstream on
loopback closes every kept-alive connection that stays idle ``--idle-close`` seconds (as vLLM's
uvicorn does after 5 s, or a proxy or mesh sidecar earlier); the router's leg pool
(:class:`disagg_router.router.upstream.h1.ConnectionPool`, keeping idle connections 4 s as the
router does) sends ``--requests`` requests to it, one at a time, in four sequences run side by side:
JSON and chunked streaming answers, each at natural timing (gaps drawn uniformly from 0 to twice the
idle close) and at the close (gaps of the idle close within +-2 ms, so the close lands as a request
is written). It prints, per sequence, the requests that failed (goal 0) and how many met the race
and were sent again on a new connection, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx

from disagg_router.router.runtime import UPSTREAM_KEEPALIVE_S
from disagg_router.router.upstream.h1 import ConnectionPool, Origin

BODY = b'{"prompt": [1, 2], "max_tokens": 1}'
JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"9\r\ndata: a\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Outcome:
    """One sequence's result."""

    name: str
    requests: int
    failed: int
    retried: int


def _closing_idle(answer: bytes, idle_s: float) -> Handler:
    """A connection handler that answers each request and closes the connection once it has
    been idle ``idle_s`` (no answer to a request that arrives later)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                async with asyncio.timeout(idle_s):
                    head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return handler


async def _sequence(name: str, answer: bytes, gaps: Sequence[float], idle_s: float) -> Outcome:
    server = await asyncio.start_server(_closing_idle(answer, idle_s), "127.0.0.1", 0)
    origin: Origin = ("127.0.0.1", server.sockets[0].getsockname()[1], False)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {origin[0]}:{origin[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    pool = ConnectionPool(5.0, 10.0, UPSTREAM_KEEPALIVE_S, 16)
    retried: list[Origin] = []
    pool.on_stale_retry = retried.append
    failed = 0
    try:
        for gap in gaps:
            await asyncio.sleep(gap)
            try:
                async with pool.request(origin, head, BODY) as call:
                    if call.status != 200 or not await call.read():
                        failed += 1
            except httpx.TransportError:
                failed += 1
    finally:
        await pool.close()
        server.close()
    return Outcome(name, len(gaps), failed, len(retried))


async def _run(requests: int, idle_s: float, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    natural = [rng.uniform(0, 2 * idle_s) for _ in range(requests)]
    at_close = [idle_s + rng.uniform(-0.002, 0.002) for _ in range(requests)]
    runs = [
        _sequence(f"{kind}, {timing}", answer, gaps, idle_s)
        for kind, answer in (("json", JSON), ("chunked stream", CHUNKED))
        for timing, gaps in (("natural timing", natural), ("close as written", at_close))
    ]
    return list(await asyncio.gather(*runs))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, run the four sequences, print a row each; 1 if any request failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.idle_close", description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="requests per sequence")
    parser.add_argument("--idle-close", type=float, default=1.0, help="upstream idle close (s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    outcomes = asyncio.run(_run(args.requests, args.idle_close, args.seed))
    print("| sequence | requests | failed | sent again after the race |")
    print("| --- | --- | --- | --- |")
    for o in outcomes:
        print(f"| {o.name} | {o.requests} | {o.failed} | {o.retried} |")
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
