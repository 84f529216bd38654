"""One instance's KV event stream against the fake vLLM's publisher, with recorded payloads:
join, gaps, restarts, an over-size message and a silent publisher."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from devstack.fakes.kv_hostile import hostile
from devstack.fakes.kv_publisher import FakeKvPublisher
from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.kv_events import (
    EventStream,
    StreamLimits,
    StreamTarget,
    StreamTiming,
)
from disagg_router.router.routing.kv_index import KvIndex
from disagg_router.router.routing.kv_wire import KvEvent, typed_events
from tests.support.wait import wait_until

RECORDING = Path(__file__).parents[1] / "recorded" / "vllm_kv_events.json"
TIMING = StreamTiming(probe_interval=0.2, probe_timeout=2.0)
LIMITS = StreamLimits(max_message_bytes=4 * 1024 * 1024, max_blocks=65536)


def _stores() -> list[bytes]:
    """The recorded payloads that store blocks only (in order: each one's parents come first)."""
    frames = json.loads(RECORDING.read_text())["frames"]
    payloads = [bytes.fromhex(f[-1]) for f in frames]
    return [p for p in payloads if b"BlockRemoved" not in p and b"AllBlocksCleared" not in p]


class Running:
    """A stream task following ``publisher`` into ``index``."""

    def __init__(self, publisher: FakeKvPublisher, timing: StreamTiming = TIMING) -> None:
        self.index = KvIndex(max_blocks=10_000)
        self.registry = CollectorRegistry()
        target = StreamTarget("tiny", "p0", publisher.endpoint, publisher.replay_endpoint, "")
        self.stream = EventStream(target, self.index, timing, KvMetrics(self.registry), LIMITS)
        self.ctx = zmq.asyncio.Context()
        self.task = asyncio.ensure_future(self.stream.run(self.ctx))

    def resyncs(self, reason: str) -> float:
        labels = {"model": "tiny", "instance": "p0", "reason": reason}
        return self.registry.get_sample_value("disagg_router_kv_resyncs_total", labels) or 0.0

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.ctx.destroy(linger=0)


async def _until(condition: object) -> None:
    assert callable(condition)
    await asyncio.to_thread(wait_until, condition, 30.0)


@pytest.fixture
async def publisher() -> AsyncIterator[FakeKvPublisher]:
    async with FakeKvPublisher() as pub:
        yield pub


async def test_a_joining_stream_replays_what_the_instance_already_holds(
    publisher: FakeKvPublisher,
) -> None:
    stores = _stores()
    for payload in stores:
        await publisher.publish(payload)
    running = Running(publisher)
    try:
        await _until(lambda: running.stream.state == "live")
        assert running.index.blocks("p0") > 0
        assert running.resyncs("join") == 1
    finally:
        await running.stop()


async def test_a_gap_is_filled_from_the_replay_socket(publisher: FakeKvPublisher) -> None:
    stores = _stores()
    running = Running(publisher, StreamTiming(probe_interval=60.0, probe_timeout=5.0))  # no probe
    try:
        await _until(lambda: running.stream.state == "live" and publisher.subscriptions > 0)
        await publisher.publish(stores[0], live=False)  # lost on the way
        await publisher.publish(stores[1])
        expected = KvIndex(max_blocks=10_000)
        for payload in stores[:2]:
            expected.apply("p0", _decoded(payload))
        await _until(lambda: running.index.blocks("p0") == expected.blocks("p0"))
        assert running.resyncs("gap") == 1
    finally:
        await running.stop()


async def test_an_over_size_message_leaves_the_stream_subscribed(
    publisher: FakeKvPublisher,
) -> None:
    """ZMQ drops the SUB's connection for the message and never reconnects it by itself: the
    stream subscribes anew, and later batches arrive live (no probe is due in this test)."""
    stores = _stores()
    running = Running(publisher, StreamTiming(probe_interval=60.0, probe_timeout=5.0))
    try:
        await _until(lambda: running.stream.state == "live" and publisher.subscriptions == 1)
        await publisher.publish(hostile("over-size message", LIMITS.max_message_bytes))
        await _until(lambda: publisher.subscriptions == 2)
        await publisher.publish(stores[0])
        expected = KvIndex(max_blocks=10_000)
        expected.apply("p0", _decoded(stores[0]))
        await _until(lambda: running.index.blocks("p0") == expected.blocks("p0"))
        assert running.stream.last_applied == 1
        assert running.resyncs("resubscribe") == 1
        labels = {"model": "tiny", "instance": "p0", "reason": "too_large"}
        bad = running.registry.get_sample_value("disagg_router_kv_bad_events_total", labels)
        assert bad == 1.0
    finally:
        await running.stop()


def _decoded(payload: bytes) -> list[KvEvent]:
    return typed_events(payload, LIMITS.max_blocks)


async def test_a_restarted_publisher_clears_the_instance(publisher: FakeKvPublisher) -> None:
    stores = _stores()
    for payload in stores:
        await publisher.publish(payload)
    running = Running(publisher)
    try:
        await _until(lambda: running.index.blocks("p0") > 0)
        publisher.restart()  # a new vLLM process: nothing cached, sequence from 0
        await _until(lambda: running.resyncs("restart") >= 1)
        assert running.index.blocks("p0") == 0
        await _until(lambda: publisher.subscriptions > 0)
        await publisher.publish(stores[0])  # the new process's first stores are followed
        await _until(lambda: running.index.blocks("p0") > 0)
    finally:
        await running.stop()


async def test_a_silent_publisher_degrades_the_instance_until_it_answers(
    publisher: FakeKvPublisher,
) -> None:
    running = Running(publisher)
    try:
        await _until(lambda: running.stream.state == "live")
        publisher.replay_answers = False
        await _until(lambda: running.stream.state == "degraded")
        assert not running.stream.routable
        degraded = {"model": "tiny", "instance": "p0"}
        value = running.registry.get_sample_value("disagg_router_kv_stream_degraded", degraded)
        assert value == 1.0
        publisher.replay_answers = True
        await _until(lambda: running.stream.state == "live")
    finally:
        await running.stop()


async def test_a_stream_with_no_publisher_never_becomes_live() -> None:
    async with FakeKvPublisher() as pub:
        target = StreamTarget("tiny", "p0", pub.endpoint, pub.replay_endpoint, "")
    running_index = KvIndex(max_blocks=10)
    stream = EventStream(target, running_index, TIMING, KvMetrics(CollectorRegistry()), LIMITS)
    ctx = zmq.asyncio.Context()
    task = asyncio.ensure_future(stream.run(ctx))
    try:
        await _until(lambda: stream.state == "degraded")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
