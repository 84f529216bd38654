"""The fake vLLM's KV event publisher: vLLM's ZMQ framing, driven by a test.

Who uses it: the router's KV-aware routing tests, with payloads recorded from a real vLLM
(``devstack.record_kv_events``). Like vLLM's ``ZmqEventPublisher`` it binds a PUB socket that sends
``(topic, 8-byte big-endian sequence number, payload)`` and a ROUTER replay socket that answers an
8-byte start sequence with every buffered batch from there, each as ``(identity, b"", topic,
sequence, payload)``, then an end marker of sequence -1. Faults a test can ask for: ``publish(...,
live=False)`` buffers a batch without sending it (a lost message: a gap),
:meth:`FakeKvPublisher.restart` starts the sequence over with an empty buffer (a restarted vLLM),
``replay_answers = False`` leaves replay requests unanswered (a dead publisher). ``subscriptions``
counts the subscriptions made (one per subscriber that joined), so a test can wait for one before
publishing (ZMQ drops what a PUB sends before a subscriber is connected).

It runs on the caller's asyncio loop (``zmq.asyncio``), binds loopback only, and must be closed
(:meth:`FakeKvPublisher.close`, or ``async with``). Many publishers in one process (an emulated
fleet) pass one shared ``context`` (each context runs an I/O thread), which the caller terms, and a
``buffer_limit`` (vLLM keeps a bounded replay buffer too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from types import TracebackType

import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FakeKvPublisher:
    """A PUB (XPUB) and a replay ROUTER on ``127.0.0.1``: ``endpoint``, ``replay_endpoint``."""

    def __init__(
        self,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        buffer_limit: int | None = None,
    ) -> None:
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.XPUB)  # a PUB that also tells who subscribed
        # Every subscriber's subscription, also one to a topic another (or a leaving) subscriber
        # holds: a subscriber that reconnects is then told apart from one that never left.
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._router = self._ctx.socket(zmq.ROUTER)
        pub_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_limit)
        self._next = 0
        self.replay_answers = True
        self.replays_served = 0
        self.subscriptions = 0
        self._server = asyncio.ensure_future(self._serve_replays())
        self._watcher = asyncio.ensure_future(self._watch_subscriptions())

    async def publish(self, payload: bytes, live: bool = True) -> int:
        """Buffer ``payload`` under the next sequence number and (``live``) send it; returns the
        sequence number."""
        seq = self._next
        self._next += 1
        self._buffer.append((seq, payload))
        if live:
            frames = [self._topic, seq.to_bytes(8, "big"), payload]
            await self._pub.send_multipart(frames, copy=False)  # large payloads: not copied
        return seq

    def restart(self) -> None:
        """Behave like a restarted vLLM: sequence numbers start at 0, the buffer is empty."""
        self._buffer.clear()
        self._next = 0

    async def _watch_subscriptions(self) -> None:
        while True:
            message = await self._pub.recv()
            if message[:1] == b"\x01":
                self.subscriptions += 1

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if not self.replay_answers or len(frames) != 3:
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replays_served += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    frames = [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    await self._router.send_multipart(frames, copy=False)
            await self._router.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        for task in (self._server, self._watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close(linger=0)
        self._router.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> FakeKvPublisher:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
