"""A broken or hostile KV event publisher, through real ZMQ sockets (the fake vLLM's publisher)
into a real :class:`EventStream` and :class:`KvIndex`: each hostile shape, sent 100 times among
good batches (the 50 MB one 10 times, under both limits), leaves the index exactly as the good
batches alone, is counted by reason, and neither ends the stream task nor takes it out of
``live``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from devstack.fakes.kv_hostile import HOSTILE_TOKENS, SHAPES, good, good_tokens, hostile
from devstack.fakes.kv_publisher import FakeKvPublisher
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
from tests.support.wait import wait_until

ROUNDS = 100
DEFAULTS = KvEventsConfig()
LIMITS = StreamLimits(DEFAULTS.max_message_bytes, DEFAULTS.max_blocks_per_event)
# the 10-million-hash store under a message limit that lets it through to the blocks bound
BIG_MESSAGES = StreamLimits(64 * 1024 * 1024, DEFAULTS.max_blocks_per_event)
REASONS = {"msgpack nested 100,000 deep": "undecodable", "over-size message": "too_large"}
CASES = [
    *[
        (shape, LIMITS, REASONS.get(shape, "invalid"), ROUNDS)
        for shape in SHAPES
        if "million" not in shape
    ],
    ("10 million hashes", LIMITS, "too_large", 10),  # refused by the sockets (MAXMSGSIZE)
    ("10 million hashes", BIG_MESSAGES, "too_many_blocks", 10),  # refused by the blocks bound
]


def _good_index(rounds: int) -> KvIndex:
    index = KvIndex(max_blocks=100_000)
    for n in range(rounds):
        index.apply("p0", typed_events(good(n), DEFAULTS.max_blocks_per_event))
    return index


def assert_same_routing(got: KvIndex, want: KvIndex, rounds: int) -> None:
    """Every good prompt and the hostile one match the same blocks in both indexes."""
    assert got.blocks("p0") == want.blocks("p0")
    for tokens in [HOSTILE_TOKENS] + [good_tokens(n) for n in range(rounds)]:
        keys = chain_keys(tokens, 16)
        assert got.matched_blocks("p0", keys) == want.matched_blocks("p0", keys), tokens
    assert got.matched_blocks("p0", chain_keys(HOSTILE_TOKENS, 16)) == 0


async def _until(condition: Callable[[], bool]) -> None:
    await asyncio.to_thread(wait_until, condition, 60.0)


@pytest.mark.parametrize(("shape", "limits", "reason", "rounds"), CASES)
async def test_a_hostile_shape_among_good_batches_changes_nothing(
    shape: str, limits: StreamLimits, reason: str, rounds: int
) -> None:
    payload = hostile(shape, limits.max_message_bytes)
    registry = CollectorRegistry()
    index = KvIndex(max_blocks=100_000)
    ctx = zmq.asyncio.Context()
    async with FakeKvPublisher() as pub:
        target = StreamTarget("tiny", "p0", pub.endpoint, pub.replay_endpoint, "")
        timing = StreamTiming(probe_interval=0.2, probe_timeout=10.0)
        stream = EventStream(target, index, timing, KvMetrics(registry), limits)
        task = asyncio.ensure_future(stream.run(ctx))
        try:
            await _until(lambda: stream.state == "live" and pub.subscriptions > 0)
            for n in range(rounds):
                await pub.publish(good(n))
                await pub.publish(payload)
            last = await pub.publish(good(rounds))
            await _until(lambda: stream.last_applied == last or task.done())
            assert not task.done()  # never ended by its input: no restart
            assert stream.state == "live"
            assert_same_routing(index, _good_index(rounds + 1), rounds + 1)
            labels = {"model": "tiny", "instance": "p0", "reason": reason}
            assert registry.get_sample_value("disagg_router_kv_bad_events_total", labels) == rounds
            degraded = {"model": "tiny", "instance": "p0"}
            assert registry.get_sample_value("disagg_router_kv_stream_degraded", degraded) == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(linger=0)
