"""One instance's KV event stream: ZMQ subscription, sequence checks, resync, liveness.

Who calls it: :class:`disagg_router.router.routing.kv_routing.KvRouting` runs one
:meth:`EventStream.run` task per instance of a model with KV events configured, and cancels it when
the instance leaves or the config changes. Everything runs on the router's event loop (ZMQ's asyncio
sockets); the stream only writes into its model's
:class:`~disagg_router.router.routing.kv_index.KvIndex` and its own state.

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

Nothing a publisher sends makes :meth:`EventStream.run` raise. A message over ``max_message_bytes``
is refused by the SUB and the replay sockets themselves (ZMQ's ``MAXMSGSIZE``: the connection drops
before the message is held; the SUB is then subscribed anew and the stream probes, so the replay
fills what the drop lost), then skipped; the SUB socket queues about ``RECEIVE_QUEUE_BYTES`` at most
while the stream is busy. A message that is no batch, a frame set of the wrong shape, a bad sequence
number, and each event of the wrong type, out of range or over ``max_blocks_per_event`` blocks
(:mod:`disagg_router.router.routing.kv_wire`) is skipped and counted by reason
(``disagg_router_kv_bad_events_total``); a skipped batch still counts as applied, so it is never
asked for again. Batches are applied event by event, large stores in slices, giving the event loop
back every ``YIELD_AFTER`` seconds. ZMQ errors do raise; the owner counts, logs and restarts the
task, and the new stream starts ``degraded`` with the failure as its reason.

``state`` is the one source of the instance's KV health: the ``disagg_router_kv_stream_degraded``
gauge is set only with it, and ``/ready``'s ``degraded`` list is read from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from disagg_router.router.observability.metrics import KvMetrics
from disagg_router.router.routing.kv_index import ApplyResult, KvIndex
from disagg_router.router.routing.kv_wire import (
    BadBatch,
    BlockStored,
    Rejected,
    decode_batch,
    decode_event,
    stored_slices,
)

log = logging.getLogger(__name__)

END_SEQ = -1
YIELD_AFTER = 0.005
"""Seconds of applying events after which the stream gives the event loop back."""
_DRAIN_POLL_MS = 1
"""How often the end of a dropped replay connection is looked for (the look is cheap)."""
STORE_SLICE = 1024
"""Blocks of one store applied at a time."""
MAX_REFUSED = 10_000
"""Messages over the limit one replay may skip (vLLM buffers 10,000 batches by default)."""
RECEIVE_QUEUE_BYTES = 32 * 1024 * 1024
"""What the SUB socket may queue while the stream is busy, in messages of the largest size."""
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


@dataclass(frozen=True)
class StreamLimits:
    """``max_message_bytes``: the largest message taken from the publisher; ``max_blocks``: the
    most block hashes one event may carry (``kv_events.max_message_bytes``,
    ``max_blocks_per_event``)."""

    max_message_bytes: int
    max_blocks: int


def receive_queue(max_message_bytes: int) -> int:
    """The SUB socket's receive high-water mark (messages): at most ``RECEIVE_QUEUE_BYTES`` of
    the largest messages, and never under 16. Beyond it ZMQ drops at the publisher, which the
    next sequence number shows as a gap (filled by a replay)."""
    return max(16, RECEIVE_QUEUE_BYTES // max_message_bytes)


class _Budget:
    """Gives the event loop back once ``YIELD_AFTER`` seconds of work have passed."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    async def spend(self) -> None:
        if time.perf_counter() - self._since >= YIELD_AFTER:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


class _Subscription:
    """The SUB socket of one stream, subscribed again whenever ZMQ drops its connection.

    ZMQ does not reconnect a SUB whose connection it dropped for a protocol error, a message over
    ``MAXMSGSIZE`` among them, so after one such message nothing would arrive again. A monitor
    tells the drop; the socket is then replaced, and :meth:`receive` says so (``reopened``) and
    returns None, as after a silence, so that the stream probes and replays what it missed.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, topic: str, limits: StreamLimits
    ) -> None:
        self._ctx, self._endpoint, self._topic, self._limits = ctx, endpoint, topic, limits
        self.reopened = False
        self._sub, self._monitor, self._poller = self._open()

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, zmq.asyncio.Poller]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sub.setsockopt(zmq.RCVHWM, receive_queue(self._limits.max_message_bytes))
        sub.setsockopt(zmq.SUBSCRIBE, self._topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self._endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return sub, monitor, poller

    async def receive(self, timeout: float) -> list[bytes] | None:
        """The next message, or None after ``timeout`` seconds of silence or a drop."""
        self.reopened = False
        ready = dict(await self._poller.poll(int(timeout * 1000)))
        if self._sub in ready:
            return list(await self._sub.recv_multipart())
        if self._monitor in ready:
            self.close()
            self._sub, self._monitor, self._poller = self._open()
            self.reopened = True
        return None

    def close(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)


class EventStream:
    """The subscription of one instance; ``state`` and ``reason`` say how it fares."""

    def __init__(
        self,
        target: StreamTarget,
        index: KvIndex,
        timing: StreamTiming,
        metrics: KvMetrics,
        limits: StreamLimits,
        clock: Callable[[], float] = time.time,
        failed: str | None = None,
    ) -> None:
        """``failed``: why the stream this one replaces stopped (it then starts degraded)."""
        self.target = target
        self.state: StreamState = "starting"
        self.reason = ""
        self._index = index
        self._timing = timing
        self._metrics = metrics
        self._limits = limits
        self._budget = _Budget()  # shared by every batch: a long replay yields too
        self._clock = clock
        self._last: int | None = None  # last sequence number applied (-1: none since seq 0)
        self._last_digest = b""  # digest of that batch's payload
        self._live_seq: int | None = None  # last sequence number received on the SUB socket
        self._probed_at = time.monotonic()
        if failed is None:
            self._set_state("starting", "waiting for the first replay")
        else:
            self._set_state("degraded", f"subscriber restarted after: {failed}")

    @property
    def last_applied(self) -> int | None:
        """The sequence number of the last batch applied or skipped (None: none yet)."""
        return self._last

    @property
    def routable(self) -> bool:
        """Whether the index may be trusted for this instance now."""
        return self.state == "live"

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Subscribe, join (replay from 0), then follow the stream until cancelled."""
        sub = _Subscription(ctx, self.target.endpoint, self.target.topic, self._limits)
        try:
            await self._resync(ctx, 0, "join")
            while True:
                frames = await sub.receive(self._timing.probe_interval)
                if sub.reopened:
                    self._metrics.count_resync(self.target, "resubscribe")
                if frames is not None:
                    await self._on_frames(ctx, frames)
                due = time.monotonic() - self._probed_at >= self._timing.probe_interval
                if frames is None or (self.state != "live" and due):
                    await self._probe(ctx)
        finally:
            sub.close()

    async def _on_frames(self, ctx: zmq.asyncio.Context, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self._metrics.count_bad(self.target, "frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if len(frames[1]) != 8 or seq < 0:
            self._metrics.count_bad(self.target, "sequence")
            return
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
            await self._apply(seq, frames[2], live=True)
        elif seq > self._last + 1:  # the replay could not fill the gap: start over from here
            await self._restart_at(seq, frames[2], "gap_unfilled")

    async def _restart_at(self, seq: int, payload: bytes, reason: str) -> None:
        self._index.clear(self.target.label)
        self._metrics.count_resync(self.target, reason)
        await self._apply(seq, payload, live=True)

    async def _apply(self, seq: int, payload: bytes | None, live: bool) -> None:
        """Apply batch ``seq`` (``payload`` None: it was over ``max_message_bytes``); a bad
        batch or event is counted and skipped, and the batch counts as applied either way."""
        self._last = seq
        self._last_digest = self._digest(payload)
        await self._budget.spend()
        if payload is None:
            self._metrics.count_bad(self.target, "too_large")
            return
        try:
            batch = decode_batch(payload)
        except BadBatch as exc:
            self._metrics.count_bad(self.target, exc.reason)
            return
        result = await self._apply_events(batch.events)
        if live:
            self._metrics.observe_lag(self.target, max(0.0, self._clock() - batch.ts))
        self._metrics.record_apply(self.target, result, self._index.blocks(self.target.label))

    async def _apply_events(self, events: list[msgspec.Raw]) -> ApplyResult:
        total = ApplyResult()
        for raw in events:
            await self._budget.spend()
            event = decode_event(raw, self._limits.max_blocks)
            if isinstance(event, Rejected):
                self._metrics.count_bad(self.target, event.reason)
                continue
            parts = stored_slices(event, STORE_SLICE) if isinstance(event, BlockStored) else [event]
            for part in parts:
                await self._budget.spend()
                total = total.plus(self._index.apply(self.target.label, [part]))
        return total

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
        await self._apply_replayed(frames)
        self._mark_live()

    @staticmethod
    def _digest(payload: bytes | None) -> bytes:
        return b"" if payload is None else hashlib.blake2b(payload, digest_size=16).digest()

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
        await self._apply_replayed(frames)
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

    async def _apply_replayed(self, frames: list[tuple[int, bytes | None]]) -> None:
        for seq, payload in frames:
            if self._last is None or seq > self._last:
                await self._apply(seq, payload, live=False)

    def _set_state(self, state: StreamState, reason: str) -> None:
        """The one place ``state`` changes; the degraded gauge follows it."""
        self.state, self.reason = state, reason
        self._metrics.set_degraded(self.target, state == "degraded")

    def _mark_live(self) -> None:
        if self.state != "live":
            log.info("kv events %s/%s: live", self.target.model, self.target.label)
        self._set_state("live", "")

    def _degrade(self, why: str) -> None:
        if self.state != "degraded":
            log.warning("kv events %s/%s degraded: %s", self.target.model, self.target.label, why)
        self._set_state("degraded", why)

    async def _replay(
        self, ctx: zmq.asyncio.Context, start: int
    ) -> list[tuple[int, bytes | None]] | None:
        """The buffered batches from ``start`` (in order; None for a batch over
        ``max_message_bytes``), or None (and degraded) when the publisher does not answer within
        ``probe_timeout``.

        The replay socket refuses a message over the limit by dropping the connection (ZMQ's
        ``MAXMSGSIZE``, so it is never held in memory): the batch after the last one received
        is then the one refused, and the replay goes on from the batch after it."""
        frames: list[tuple[int, bytes | None]] = []
        for _ in range(MAX_REFUSED + 1):
            got = await self._replay_once(ctx, start)
            if got is None:
                self._degrade(f"no answer from {self.target.replay_endpoint}")
                return None
            part, complete = got
            frames += part
            if complete:
                return frames
            refused = part[-1][0] + 1 if part else start
            frames.append((refused, None))
            start = refused + 1
        self._degrade(f"{self.target.replay_endpoint} refused over {MAX_REFUSED} times in a replay")
        return None

    async def _replay_once(
        self, ctx: zmq.asyncio.Context, start: int
    ) -> tuple[list[tuple[int, bytes | None]], bool] | None:
        """One replay request: the batches received and whether the end marker came (False:
        the connection dropped first), or None after ``probe_timeout``."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(self.target.replay_endpoint)
            async with asyncio.timeout(self._timing.probe_timeout):
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
                return await self._replies(sock, monitor)
        except TimeoutError:
            return None
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _replies(
        self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket
    ) -> tuple[list[tuple[int, bytes | None]], bool]:
        frames: list[tuple[int, bytes | None]] = []
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            await self._budget.spend()  # queued replies are read without a pause otherwise
            ready = dict(await poller.poll())
            if sock not in ready:  # the connection dropped
                return await self._rest_after_drop(sock, frames), False
            if self._take(await sock.recv_multipart(), frames):
                return frames, True

    async def _rest_after_drop(
        self, sock: zmq.asyncio.Socket, frames: list[tuple[int, bytes | None]]
    ) -> list[tuple[int, bytes | None]]:
        """Read what came before the drop. ZMQ reports the drop to the monitor *before* it
        hands the messages decoded with the refused one to the socket, so the drop alone does
        not say all is there. The socket closing its pipe does: the pipe's end is queued behind
        those messages, and from then on the socket takes no more requests (no ``POLLOUT``).
        A drop without that (the publisher went away, ZMQ reconnects) ends at the deadline."""
        while _events(sock) & zmq.POLLOUT:
            if await sock.poll(timeout=_DRAIN_POLL_MS):
                self._take(await sock.recv_multipart(), frames)
        while _events(sock) & zmq.POLLIN:
            await self._budget.spend()
            self._take(await sock.recv_multipart(), frames)
        return frames

    @staticmethod
    def _take(parts: list[bytes], frames: list[tuple[int, bytes | None]]) -> bool:
        """Add one replay message to ``frames``; True for the end marker."""
        if len(parts) != 4 or len(parts[2]) != 8:
            return False
        seq = int.from_bytes(parts[2], "big", signed=True)
        if seq >= 0:
            frames.append((seq, parts[3]))
        return seq == END_SEQ


def _events(sock: zmq.asyncio.Socket) -> int:
    """The socket's ``POLLIN``/``POLLOUT`` state now (reading it lets ZMQ catch up first)."""
    return int(sock.get(zmq.EVENTS))
