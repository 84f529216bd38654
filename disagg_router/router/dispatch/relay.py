"""The relay of one attempt after its commit point: D's events to the client, P's usage merged.

Who calls it: :class:`disagg_router.router.dispatch.attempt.Dispatch` (``sse_events()`` for a
stream, whose bytes the HTTP layer writes; ``json_response()`` for one answer). Once the commit
point has passed, the client already has (or is about to get) a 200: a stream then ends with
``[DONE]`` or with one SSE error event, never with an exception. Two timers bound a stream, one
handle each rather than one per token: the request's ``timeouts.total`` deadline and D's silence
after its first token (``timeouts.inter_token``; a stall is logged, counted and fed to D's breaker).
Every wait for P's usage is bounded by the deadline. D's events go out as the bytes D sent
(:mod:`disagg_router.router.upstream.sse` keeps them ready for the client); only an event with a
``usage`` is parsed, merged and encoded again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from functools import partial
from typing import Any

from disagg_router.router.dispatch.legs import leg_failed
from disagg_router.router.dispatch.state import Attempt, DecodeItem, End, Outlet
from disagg_router.router.errors import (
    RouterError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    error_payload,
)
from disagg_router.router.observability.timeline import ttft_stages
from disagg_router.router.upstream import codec
from disagg_router.router.upstream.rewrite import client_response, merge_usage, prefill_usage
from disagg_router.router.upstream.sse import DONE_EVENT, encode_event

log = logging.getLogger(__name__)

_USAGE = b'"usage"'
"""The mark of an event whose usage the relay merges (P's prompt tokens into D's)."""


def sse_error_event(exc: RouterError) -> bytes:
    """The one SSE event sent when a stream fails after its first byte went out."""
    return encode_event(json.dumps(error_payload(exc)).encode())


class StreamBroken(Exception):
    """D's leg failed mid-stream and the attempt's owner takes the stream on
    (:attr:`~disagg_router.router.dispatch.state.Attempt.hand_over` said so): raised by
    :meth:`Relay.sse_events` after every event D sent before the failure was given."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error


class Relay:
    """The client's side of one committed attempt (see the module docstring)."""

    def __init__(self, attempt: Attempt) -> None:
        self._a = attempt
        self._stall_timer: asyncio.TimerHandle | None = None

    @property
    def attempt(self) -> Attempt:
        return self._a

    def sse_events(self, outlet: Outlet | None = None) -> SseEvents:
        """Client SSE bytes from the first token on; a later failure ends it with one error event.

        What D has already sent goes out in one write (the events of one upstream read arrive
        together); nothing waits for more, so the client sees every event as soon as it would
        alone. Sets the attempt's ``outcome`` before it gives the stream's last chunk, and only
        then (the response ends the body with that chunk). Never raises :class:`RouterError`
        (headers are already sent). The caller must ``aclose()`` it (its timers).

        ``outlet``: while the caller waits for the next chunk, D's events that need nothing
        from the relay (no usage to merge) are written to it straight from the socket read
        that brought them, with no task woken per read; anything else, and everything once
        the outlet is not ready, comes back as chunks, in order.
        """
        return SseEvents(self, outlet)

    def _start_timers(self) -> asyncio.TimerHandle | None:
        """Arm the deadline and the stall timer; returns the deadline's. None when D's leg has
        already ended: all it sent, and its end, are queued, so there is nothing to time (the
        wait for P's usage has its own bound)."""
        a = self._a
        d_task = a.d_task
        ended = d_task is not None and d_task.done() and not d_task.cancelled()
        if ended and d_task is not None and d_task.exception() is None:  # its end is queued
            return None
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(max(a.deadline - time.monotonic(), 0.0), self._expire)
        self._stall_timer = loop.call_later(a.runtime.settings.timeouts.inter_token, self._stall)
        return expiry

    def _stop_timers(self, expiry: asyncio.TimerHandle) -> None:
        expiry.cancel()
        if self._stall_timer is not None:
            self._stall_timer.cancel()

    async def _ready_events(self, item: DecodeItem | None) -> tuple[list[bytes], DecodeItem | None]:
        """Client events for ``item`` and the events queued behind it; returns them with the
        first item not taken (None: the queue is empty). An event with a usage waits for P's
        answer while P is still running, so it then starts a batch of its own: the events
        before it are not held back (P done, the usual case: one batch, one write)."""
        batch: list[bytes] = []
        while isinstance(item, bytes):
            found = item.find(_USAGE)
            if found >= 0:
                start = item.rfind(b"\n\n", 0, found) + 2  # where its event starts (-1 + 2: 1st)
                start = 0 if start == 1 else start
                if start:
                    batch.append(item[:start])
                if batch and self._usage_waits():  # what comes before it goes out first
                    return batch, item[start:]
                end = item.find(b"\n\n", found) + 2
                batch.append(await self._usage_event(item[start:end]))
                item = item[end:]
                if item:
                    continue
            else:
                batch.append(item)
            try:
                item = self._a.queue.get_nowait()
            except asyncio.QueueEmpty:
                item = None
        return batch, item

    def _usage_waits(self) -> bool:
        """Whether merging a usage would wait for P (P's leg still running)."""
        p_task = self._a.p_task
        return p_task is not None and not p_task.done()

    async def _usage_event(self, event: bytes) -> bytes:
        """``event`` (``data: <chunk>\n\n``) with P's usage merged into its ``usage``."""
        try:
            chunk = codec.loads(event[6:-2])
        except ValueError:
            chunk = None
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            chunk["usage"] = self._a.usage = merge_usage(
                chunk["usage"], await self._prefill_usage()
            )
            return encode_event(codec.dumps(chunk))
        return event

    def handed_over(self, item: DecodeItem | None) -> UpstreamError | None:
        """``item`` when it is D's failure and the attempt's owner continues the stream."""
        hand_over = self._a.hand_over
        if hand_over is None or not isinstance(item, UpstreamError) or item.leg != "decode":
            return None
        return item if hand_over(item) else None

    def _end_event(self, item: DecodeItem | None) -> bytes | None:
        """The stream's last event if ``item`` ends it (sets ``outcome``); None otherwise."""
        if isinstance(item, End):
            self._a.outcome = "ok"
            self._a.answered = time.monotonic()
            return DONE_EVENT
        if isinstance(item, RouterError):
            self._a.outcome = "decode_failed_midstream"
            log.warning("dispatch %s failed mid-stream: %s", self._a.request_id, item.message)
            return sse_error_event(item)
        return None

    def _expire(self) -> None:
        """At the request's deadline, queue the error that ends the stream (what D queued
        before it is still relayed)."""
        limit = self._a.runtime.settings.timeouts.total
        self._a.queue.put_nowait(
            UpstreamTimeout("decode", self._a.decode.label, f"total {limit:g}s exceeded")
        )

    def _stall(self) -> None:
        """D sent nothing for ``timeouts.inter_token`` since its last payload: queue the error
        that ends the stream, count it against D's breaker. Re-arms itself for the rest of the
        period while D is sending; does nothing once D's leg has ended."""
        a = self._a
        limit = a.runtime.settings.timeouts.inter_token
        if a.d_task is None or a.d_task.done():
            return
        idle = time.monotonic() - a.last_token
        if idle < limit:
            self._stall_timer = asyncio.get_running_loop().call_later(limit - idle, self._stall)
            return
        exc = UpstreamTimeout(
            "decode", a.decode.label, f"no token for {limit:g}s (timeouts.inter_token)"
        )
        log.warning("dispatch %s: decode %s stalled mid-stream", a.request_id, a.decode.label)
        a.runtime.metrics.stream_stalls.inc()
        leg_failed(a.runtime, a.decode, exc)
        a.queue.put_nowait(exc)

    async def json_response(self) -> dict[str, Any]:
        """The non-streamed answer for the client (after the commit point), usage merged."""
        a = self._a
        if not isinstance(a.first, dict):
            raise UpstreamProtocolError("decode", a.decode.label, "unexpected streamed answer")
        a.outcome = "ok"
        answer = client_response(a.first, await self._prefill_usage())
        a.usage, a.answered = answer.get("usage"), time.monotonic()
        self._observe_ttft_stages()
        return answer

    async def _prefill_usage(self) -> Any:
        """P's usage, waiting for P (bounded by the request's deadline); None if P failed."""
        p_task = self._a.p_task
        if p_task is None:
            return None
        try:
            if p_task.done():  # the usual case: nothing to wait for, no shield to build
                answer = p_task.result()
            else:
                async with asyncio.timeout(max(self._a.deadline - time.monotonic(), 0.0)):
                    answer = await asyncio.shield(p_task)
        except (RouterError, TimeoutError):
            return None
        return prefill_usage(answer)

    def _observe_ttft_stages(self) -> None:
        """Record the TTFT stages once the first answer byte is on its way to the client."""
        a = self._a
        a.stamp("client_first")
        m = a.runtime.metrics
        for stage, seconds in ttft_stages({**a.timings, **a.stamps}).items():
            m.child(m.ttft_stage, stage).observe(seconds)


class SseEvents:
    """:meth:`Relay.sse_events`' iterator: an object, not an async generator, as every
    streamed request makes one (an async generator costs the event loop's bookkeeping).
    Timers start at the first ``__anext__`` (none if D's leg has ended by then) and stop when
    it ends, fails or ``aclose()``s."""

    def __init__(self, relay: Relay, outlet: Outlet | None) -> None:
        self._relay = relay
        self._outlet = outlet
        self._spliced = 0  # reads written to the outlet
        self._item: DecodeItem | None = relay.attempt.first
        self._started = False
        self._expiry: asyncio.TimerHandle | None = None
        self._sent: tuple[bool, bool] | None = None  # (had events, ended) of the last chunk
        self._broken: UpstreamError | None = None  # handed over after the last chunk
        self._closed = False

    def __aiter__(self) -> SseEvents:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._next()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop the timers (idempotent); nothing more is given."""
        if not self._closed:
            self._closed = True
            if self._expiry is not None:
                self._relay._stop_timers(self._expiry)
            if self._spliced:
                self._relay.attempt.runtime.metrics.relay_spliced_reads.inc(self._spliced)

    async def _next(self) -> bytes:
        relay, a = self._relay, self._relay.attempt
        if not self._started:
            self._started = True
            self._expiry = relay._start_timers()
        elif self._sent is not None:  # what follows handing the last chunk over
            had_events, ended = self._sent
            self._sent = None
            if had_events and "client_first" not in a.stamps:
                relay._observe_ttft_stages()
            if ended:
                raise StopAsyncIteration
            if self._broken is not None:
                raise StreamBroken(self._broken)
            if not isinstance(self._item, bytes):
                self._item = await self._wait()
        while True:
            events, self._item = await relay._ready_events(self._item)
            if (broken := relay.handed_over(self._item)) is not None:
                if not events:
                    raise StreamBroken(broken)
                self._sent, self._broken = (True, False), broken  # raised at the next call
                return b"".join(events)
            end = relay._end_event(self._item)
            if events or end is not None:
                self._sent = (bool(events), end is not None)
                return b"".join(events if end is None else [*events, end])
            if not isinstance(self._item, bytes):
                self._item = await self._wait()

    async def _wait(self) -> DecodeItem:
        """The attempt's next item; meanwhile D's stream is spliced to the outlet when it can
        be (nothing queued, an outlet, D's reader still reading)."""
        a = self._relay.attempt
        reader = a.reader
        if (
            len(a.queue)
            or self._outlet is None
            or reader is None
            or not reader.splice(partial(self._forward, a, self._outlet))
        ):
            return await a.queue.get()
        try:
            return await a.queue.get()
        finally:
            reader.splice(None)

    def _forward(self, a: Attempt, outlet: Outlet, events: bytes) -> None:
        """D's events from the socket's callback (spliced; ``a``: the attempt whose reader
        is spliced, ``outlet``: where they go): to the outlet when nothing in them needs the
        relay and the outlet is ready, else queued (and the splice ends, so what follows is
        queued behind them). Never raises."""
        a.last_token = time.monotonic()
        if outlet.ready() and _USAGE not in events:
            outlet.write(events)
            self._spliced += 1
            return
        if a.reader is not None:
            a.reader.splice(None)
        a.queue.put_nowait(events)
