"""``python -m bench.kv_hostile``: a broken or hostile KV event publisher against the router's
event stream, through real ZMQ sockets.

Who calls it: a person, for the fault matrix (docs/benchmarks/fault-matrix.md). For each shape
of :mod:`devstack.fakes.kv_hostile` it publishes ``--rounds`` good batches, each followed by one
hostile batch (references: ``good only``; the largest legal batch instead of a hostile one; a
join replay of ``100 * rounds`` good batches), from the fake vLLM publisher (a child process
of this command, as vLLM is another process) into the router's
:class:`~disagg_router.router.routing.kv_events.EventStream` and
:class:`~disagg_router.router.routing.kv_index.KvIndex` under the default ``kv_events`` limits, and
prints one row per shape: restarts of the stream task (restarted like the router does), the event
loop's longest stall (a task that sleeps 1 ms and measures how late it wakes), RSS growth of this
process (the peak over the run and what is left at its end, against the RSS before the stream
starts) and whether the index routes exactly as the good batches alone. It exits 1 when any row
misses the goals (no restart, stall under 50 ms, RSS growth under 50 MB, routing equal).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio
from prometheus_client import CollectorRegistry

from bench.soak import process_sample
from devstack.fakes.kv_hostile import (
    BLOCK,
    HOSTILE_TOKENS,
    LARGEST_LEGAL,
    SHAPES,
    good,
    good_tokens,
    hostile,
    largest_legal,
)
from devstack.fakes.kv_publisher import FakeKvPublisher
from devstack.process import ChildProcess, ProcessSpec
from disagg_router.router.config import KvEventsConfig
from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.block_keys import chain_keys
from disagg_router.router.routing.kv_events import (
    EventStream,
    StreamLimits,
    StreamTarget,
    StreamTiming,
)
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import typed_events

GOOD_ONLY = "good only"
JOIN_REPLAY = "join replay of 100 x rounds good batches"
SHAPES_AND_GOOD = (GOOD_ONLY, *SHAPES, LARGEST_LEGAL, JOIN_REPLAY)
MAX_STALL_MS = 50.0
MAX_RSS_MB = 50.0


@dataclass(frozen=True)
class Row:
    """One shape's figures."""

    shape: str
    restarts: int
    max_stall_ms: float
    rss_peak_mb: float
    rss_end_mb: float
    routing_equal: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return (
            self.restarts == 0
            and self.max_stall_ms < MAX_STALL_MS
            and self.rss_peak_mb < MAX_RSS_MB
            and self.routing_equal
        )


class _Probe:
    """The event loop's longest stall and the process's peak RSS, sampled every millisecond."""

    def __init__(self) -> None:
        self.max_stall = 0.0
        self.peak_kib = 0

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            self.max_stall = max(self.max_stall, time.perf_counter() - started - 0.001)
            self.peak_kib = max(self.peak_kib, _rss_kib())


def _rss_kib() -> int:
    return process_sample(os.getpid())[0]


@dataclass(frozen=True)
class Publication:
    """One batch the publisher sends: ``live`` False only buffers it (for the join replay);
    ``good`` says whether the router must apply it."""

    payload: bytes
    live: bool
    good: bool


def plan(shape: str, rounds: int, config: KvEventsConfig) -> list[Publication]:
    """What the publisher sends for ``shape``: ``rounds`` good batches each followed by the
    shape's batch, then one more good batch; for ``JOIN_REPLAY``, ``100 * rounds`` good batches
    buffered before the subscriber joins (one replay brings them all), then one live."""
    if shape == JOIN_REPLAY:
        buffered = [Publication(good(n), False, True) for n in range(100 * rounds)]
        return [*buffered, Publication(good(100 * rounds), True, True)]
    out: list[Publication] = []
    for n in range(rounds):
        out.append(Publication(good(n), True, True))
        if shape == LARGEST_LEGAL:
            legal = largest_legal(config.max_message_bytes, config.max_blocks_per_event)
            out.append(Publication(legal, True, True))
        elif shape != GOOD_ONLY:
            out.append(Publication(hostile(shape, config.max_message_bytes), True, False))
    return [*out, Publication(good(rounds), True, True)]


def _expected_index(publications: list[Publication], config: KvEventsConfig) -> KvIndex:
    """The index the good batches alone give."""
    index = KvIndex(max_blocks=100_000)
    for sent in publications:
        if sent.good:
            index.apply("p0", typed_events(sent.payload, config.max_blocks_per_event))
    return index


def _same_routing(got: KvIndex, want: KvIndex, rounds: int) -> bool:
    prompts = [HOSTILE_TOKENS] + [good_tokens(n) for n in range(rounds)]
    keys = [chain_keys(tokens, BLOCK) for tokens in prompts]
    return got.blocks("p0") == want.blocks("p0") and all(
        got.matched_blocks("p0", k) == want.matched_blocks("p0", k) for k in keys
    )


async def _publisher_main(shape: str, rounds: int, out: Path) -> None:
    """The child: bind, write the endpoints to ``out``/endpoints, wait for a subscriber,
    publish, write the last sequence number to ``out``/last, then serve replays until
    stopped."""
    publications = plan(shape, rounds, KvEventsConfig())
    async with FakeKvPublisher() as pub:
        for sent in publications:
            if not sent.live:
                await pub.publish(sent.payload, live=False)
        _write(out / "endpoints", f"{pub.endpoint} {pub.replay_endpoint}")
        while pub.subscriptions == 0:
            await asyncio.sleep(0.01)
        last = -1
        for sent in publications:
            if sent.live:
                last = await pub.publish(sent.payload)
        _write(out / "last", str(last))
        await asyncio.Event().wait()


def _write(path: Path, text: str) -> None:
    staged = path.with_suffix(".tmp")
    staged.write_text(text)
    staged.replace(path)


async def _file(path: Path, child: ChildProcess) -> str:
    while not path.exists():
        if not child.is_alive():
            raise RuntimeError(f"the publisher exited: {child.log_tail()}")
        await asyncio.sleep(0.01)
    return path.read_text()


async def _measure(shape: str, rounds: int, config: KvEventsConfig, work: Path) -> Row:
    limits = StreamLimits(config.max_message_bytes, config.max_blocks_per_event)
    out = work / f"shape{SHAPES_AND_GOOD.index(shape)}"
    out.mkdir()
    argv = (sys.executable, "-m", "bench.kv_hostile", "--publisher", str(out), "--rounds")
    spec = ProcessSpec("kv-publisher", (*argv, str(rounds), "--shape", shape), out / "log")
    with ChildProcess(spec) as child:
        endpoint, replay = (await _file(out / "endpoints", child)).split()
        index, ctx, probe = KvIndex(max_blocks=100_000), zmq.asyncio.Context(), _Probe()
        timing = StreamTiming(probe_interval=0.5, probe_timeout=config.probe_timeout)
        metrics, target = (
            KvMetrics(CollectorRegistry()),
            StreamTarget("b", "p0", endpoint, replay, ""),
        )
        gc.collect()
        base, started = _rss_kib(), time.perf_counter()
        probe.peak_kib = base
        stream = EventStream(target, index, timing, metrics, limits)
        tasks = [asyncio.ensure_future(stream.run(ctx)), asyncio.ensure_future(probe.run())]
        try:
            last = int(await _file(out / "last", child))
            restarts = 0
            while stream.last_applied != last:
                if tasks[0].done():  # what the router's owner does: count, start a new stream
                    restarts += 1
                    failed = "cancelled" if tasks[0].cancelled() else repr(tasks[0].exception())
                    stream = EventStream(target, index, timing, metrics, limits, failed=failed)
                    tasks[0] = asyncio.ensure_future(stream.run(ctx))
                if time.perf_counter() - started > 900:
                    raise TimeoutError(f"{shape}: the stream did not catch up in 900 s")
                await asyncio.sleep(0.01)
            seconds = time.perf_counter() - started
            gc.collect()
            end = _rss_kib()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.destroy(linger=0)
    good_batches = 100 * rounds + 1 if shape == JOIN_REPLAY else rounds + 1
    expected = _expected_index(plan(shape, rounds, config), config)
    equal = _same_routing(index, expected, good_batches)
    peak_mb, end_mb = (probe.peak_kib - base) / 1024, (end - base) / 1024
    return Row(shape, restarts, probe.max_stall * 1000, peak_mb, end_mb, equal, seconds)


def format_rows(rows: Sequence[Row], rounds: int) -> str:
    """The rows as a Markdown table."""
    head = (
        f"| shape ({rounds} among {rounds + 1} good batches) | restarts | max loop stall (ms) "
        "| RSS growth peak / end (MB) | routing equal to good-only | s |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
    )
    body = "".join(
        f"| {r.shape} | {r.restarts} | {r.max_stall_ms:.1f} | {r.rss_peak_mb:.1f} / "
        f"{r.rss_end_mb:.1f} | {'yes' if r.routing_equal else 'no'} | {r.seconds:.1f} |\n"
        for r in rows
    )
    return head + body


async def _run(shapes: Sequence[str], rounds: int) -> list[Row]:
    config = KvEventsConfig()
    with tempfile.TemporaryDirectory(prefix="kv-hostile-") as work:
        return [await _measure(shape, rounds, config, Path(work)) for shape in shapes]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_hostile", description=__doc__)
    parser.add_argument("--rounds", type=int, default=100, help="hostile batches per shape")
    parser.add_argument(
        "--shape", action="append", choices=SHAPES_AND_GOOD, help="default: every shape"
    )
    parser.add_argument("--publisher", type=Path, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.publisher is not None:
        asyncio.run(_publisher_main(args.shape[0], args.rounds, args.publisher))
        return 0
    rows = asyncio.run(_run(args.shape or SHAPES_AND_GOOD, args.rounds))
    print(format_rows(rows, args.rounds), end="")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
