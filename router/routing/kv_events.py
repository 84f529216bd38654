"""One instance's KV event stream: ZMQ subscription, sequence checks, resync, liveness.

Who calls it: :class:`router.routing.kv_routing.KvRouting` runs one :meth:`EventStream.run` task
per instance of a model with KV events configured, and cancels it when the instance leaves or
the config changes. Everything runs on the router's event loop (ZMQ's asyncio sockets); the
stream only writes into its model's :class:`~router.routing.kv_index.KvIndex` and its own state.

vLLM's ZMQ publisher sends multipart ``(topic, sequence number (8 bytes, big-endian), msgpack
KVEventBatch [ts, events, data_parallel_rank])`` and answers a replay request (8-byte start
sequence, sent to its ROUTER ``replay_endpoint``) with every buffered batch from there, then an
end marker of sequence -1. The stream uses that as follows:

- join: it asks for a replay from 0 (the buffer holds the last ``buffer_steps`` batches; if the
  oldest is gone, what is left still applies: blocks whose parent is unknown stay unindexed);
- gap (a live sequence number skips ahead): replay from the first missing one; if the replay
  cannot fill it, the instance is cleared and refills from the new events;
- restart (the live sequence goes backwards, or a probe finds another batch under the last
  sequence number seen): clear, then replay from 0;
- silence (no event for ``probe_interval``): a replay from the last sequence number seen probes
  the publisher; no answer within ``probe_timeout`` marks the instance ``degraded`` (routing
  falls back to approximate affinity for its pool) until an answer comes.

The stream never raises out of :meth:`EventStream.run` for a bad payload (counted, skipped, as a
gap); ZMQ errors do raise, and the owner counts, logs and restarts the task.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from router.observability.metrics import KvMetrics
from router.routing.kv_index import KvIndex

log = logging.getLogger(__name__)

END_SEQ = -1
StreamState = Literal["starting", "live", "degraded"]


@dataclass(frozen=True)
class StreamTarget:
    """Where one instance publishes: its PUB endpoint, its replay endpoint and topic."""

    model: str
    label: str
    endpoint: str
    replay_endpoint: str
    topic: str


@dataclass(frozen=True)
class StreamTiming:
    """``probe_interval``: silence before a liveness probe; ``probe_timeout``: the probe's (and
    any replay's) deadline."""

    probe_interval: float
    probe_timeout: float


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]] | None:
    """``(ts, events)`` of one msgpack KVEventBatch, or None if it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return None
    ts, events = batch[0], batch[1]
    if not isinstance(ts, (int, float)) or not all(isinstance(e, dict) for e in events):
        return None
    return float(ts), events


class EventStream:
    """The subscription of one instance; ``state`` and ``reason`` say how it fares."""

    def __init__(
        self,
        target: StreamTarget,
        index: KvIndex,
        timing: StreamTiming,
        metrics: KvMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.target = target
        self.state: StreamState = "starting"
        self.reason = "waiting for the first replay"
        self._index = index
        self._timing = timing
        self._metrics = metrics
        self._clock = clock
        self._last: int | None = None  # last sequence number applied (-1: none since seq 0)
        self._last_digest = b""  # digest of that batch's payload
        self._live_seq: int | None = None  # last sequence number received on the SUB socket
        self._probed_at = time.monotonic()

    @property
    def routable(self) -> bool:
        """Whether the index may be trusted for this instance now."""
        return self.state == "live"

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Subscribe, join (replay from 0), then follow the stream until cancelled."""
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.target.topic.encode())
            sub.connect(self.target.endpoint)
            await self._resync(ctx, 0, "join")
            interval_ms = int(self._timing.probe_interval * 1000)
            while True:
                got = await sub.poll(interval_ms)
                if got:
                    await self._on_frames(ctx, await sub.recv_multipart())
                due = time.monotonic() - self._probed_at >= self._timing.probe_interval
                if not got or (self.state != "live" and due):
                    await self._probe(ctx)
        finally:
            sub.close(linger=0)

    async def _on_frames(self, ctx: zmq.asyncio.Context, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._metrics.count_bad(self.target)
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        restarted = self._live_seq is not None and seq <= self._live_seq
        self._live_seq = seq
        if restarted:
            await self._resync(ctx, 0, "restart")
            return
        if self._last is not None and seq <= self._last:
            return  # already applied from a replay
        if self._last is not None and seq > self._last + 1:
            await self._resync(ctx, self._last + 1, "gap")
        if self._last is None or seq == self._last + 1:
            self._apply(seq, frames[2], live=True)
        elif seq > self._last + 1:  # the replay could not fill the gap: start over from here
            self._restart_at(seq, frames[2], "gap_unfilled")

    def _restart_at(self, seq: int, payload: bytes, reason: str) -> None:
        self._index.clear(self.target.label)
        self._metrics.count_resync(self.target, reason)
        self._apply(seq, payload, live=True)

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        batch = decode_batch(payload)
        self._last = seq
        self._last_digest = hashlib.blake2b(payload, digest_size=16).digest()
        if batch is None:
            self._metrics.count_bad(self.target)
            return
        ts, events = batch
        result = self._index.apply(self.target.label, events)
        if live:
            self._metrics.observe_lag(self.target, max(0.0, self._clock() - ts))
        self._metrics.record_apply(self.target, result, self._index.blocks(self.target.label))

    async def _probe(self, ctx: zmq.asyncio.Context) -> None:
        """After a silence: ask for a replay from the last batch seen; the same batch back means
        the same publisher (any later batches are applied), another one means a restart."""
        self._probed_at = time.monotonic()
        if self._last is None:
            await self._resync(ctx, 0, "join")
            return
        frames = await self._replay(ctx, max(self._last, 0))
        if frames is None:
            return
        same = self._last < 0 or (
            bool(frames)
            and frames[0][0] == self._last
            and self._digest(frames[0][1]) == self._last_digest
        )
        if not same:
            await self._resync(ctx, 0, "restart")
            return
        self._apply_replayed(frames)
        self._mark_live()

    @staticmethod
    def _digest(payload: bytes) -> bytes:
        return hashlib.blake2b(payload, digest_size=16).digest()

    async def _resync(self, ctx: zmq.asyncio.Context, start: int, reason: str) -> None:
        """Replay from ``start`` (0: the instance's whole buffered history, after clearing)."""
        frames = await self._replay(ctx, start)
        if frames is None:
            return
        self._metrics.count_resync(self.target, reason)
        complete = not frames or frames[0][0] == start
        if start == 0 or not complete:
            self._index.clear(self.target.label)
            self._last = start - 1 if complete else None
        if start != 0 and not complete:
            self._metrics.count_resync(self.target, "replay_incomplete")
        self._apply_replayed(frames)
        self._mark_live()
        log.info(
            "kv events %s/%s: %s resync from %d, %d batches, %d blocks",
            self.target.model,
            self.target.label,
            reason,
            start,
            len(frames),
            self._index.blocks(self.target.label),
        )

    def _apply_replayed(self, frames: list[tuple[int, bytes]]) -> None:
        for seq, payload in frames:
            if self._last is None or seq > self._last:
                self._apply(seq, payload, live=False)

    def _mark_live(self) -> None:
        if self.state != "live":
            log.info("kv events %s/%s: live", self.target.model, self.target.label)
        self.state, self.reason = "live", ""
        self._metrics.set_degraded(self.target, False)

    def _degrade(self, why: str) -> None:
        if self.state != "degraded":
            log.warning("kv events %s/%s degraded: %s", self.target.model, self.target.label, why)
        self.state, self.reason = "degraded", why
        self._metrics.set_degraded(self.target, True)

    async def _replay(self, ctx: zmq.asyncio.Context, start: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from ``start`` (in order), or None (and degraded) when the
        publisher does not answer within ``probe_timeout``."""
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.target.replay_endpoint)
            async with asyncio.timeout(self._timing.probe_timeout):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                return await self._replies(sock)
        except TimeoutError:
            self._degrade(f"no answer from {self.target.replay_endpoint}")
            return None
        finally:
            sock.close(linger=0)

    @staticmethod
    async def _replies(sock: zmq.asyncio.Socket) -> list[tuple[int, bytes]]:
        frames: list[tuple[int, bytes]] = []
        while True:
            parts = await sock.recv_multipart()
            if len(parts) != 4:
                continue
            seq = int.from_bytes(parts[2], "big", signed=True)
            if seq == END_SEQ:
                return frames
            frames.append((seq, parts[3]))
