"""One P/D dispatch: both legs of one attempt, shared by push and pull mode.

Who calls it: :func:`router.dispatch.orchestrator.open_dispatch`, which chooses the pair and may
retry.
Lifecycle: ``open()`` runs the legs up to the commit point (D's first token, or D's whole answer
for a non-streamed request); then ``sse_events()`` or ``json_response()`` relays the rest; then
``close()`` (always, also on errors and disconnects) cancels whatever still runs.

The only difference between the modes is when the D leg may start: in push mode right away with
P's identity (so D's block registration overlaps prefill); in pull mode after P answered, with
the ``kv_transfer_params`` P returned. Everything else (timeouts, commit point, relay, usage
merge, cancellation) is one code path. Every wait is bounded by a configured timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any

from router.config import PushIdentity
from router.dispatch.ids import new_request_id
from router.dispatch.rewrite import (
    client_response,
    decode_body_pull,
    decode_body_push,
    identity_from_kv,
    merge_usage,
    prefill_body,
    prefill_usage,
    strip_client_fields,
)
from router.dispatch.timeline import ttft_stages
from router.errors import (
    NoBackendAvailable,
    RouterError,
    RouterNotReady,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    error_payload,
)
from router.health.admission import Slot
from router.health.monitor import learn_identity
from router.http.context import RequestContext
from router.http.validation import ClientRequest
from router.observability.tracing import Span, span_attributes
from router.routing.backends import BackendState, Role
from router.runtime import Runtime
from router.upstream import codec
from router.upstream.calls import open_sse, post_json

log = logging.getLogger(__name__)


class _End:
    """Queue sentinel: the D leg finished cleanly."""


_END = _End()
DecodeItem = str | dict[str, Any] | RouterError | _End


def sse_error_event(exc: RouterError) -> bytes:
    """The one SSE event sent when a stream fails after its first byte went out."""
    return b"data: " + json.dumps(error_payload(exc)).encode() + b"\n\n"


class Dispatch:
    """Both legs of one attempt on one (P, D) pair with one fresh request id.

    ``prefill`` None: D alone (conditional disaggregation): D gets the client's request as is
    (without ``kv_transfer_params``) and prefills locally; there is no P leg and no transfer.
    """

    def __init__(
        self,
        runtime: Runtime,
        request: ClientRequest,
        prefill: BackendState | None,
        decode: BackendState,
        ctx: RequestContext | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> None:
        """``deadline``: the ``time.monotonic()`` by which the client request must end (the
        ``timeouts.total`` of the first attempt; default: ``total`` from now)."""
        self.runtime = runtime
        self.request = request
        self.prefill = prefill
        self.decode = decode
        self.ctx = ctx or RequestContext()
        self.request_id = request_id or new_request_id()
        self.transfer_id = self.request_id
        self.started = time.monotonic()
        self.deadline = deadline or self.started + runtime.settings.timeouts.total
        self.outcome = "in_progress"
        self._queue: asyncio.Queue[DecodeItem] = asyncio.Queue()
        self._p_task: asyncio.Task[dict[str, Any]] | None = None
        self._d_task: asyncio.Task[None] | None = None
        self._sent_identity: PushIdentity | None = None
        self._first: DecodeItem = _END
        self._last_token = 0.0  # time.monotonic() of D's last streamed payload
        self._stall_timer: asyncio.TimerHandle | None = None
        self._slots: dict[str, Slot] = {}
        self.timings: dict[str, float] = {}  # stage -> seconds since ``started``
        # The in-flight counts Pool.choose() took for this attempt's legs, given back once each.
        self._counted = {b.role: b for b in (prefill, decode) if b is not None}
        for backend in self._counted.values():
            self._show_in_flight(backend)
        self._stamps: dict[str, float] = {}  # more moments for the TTFT stages, same clock

    def _mark(self, stage: str) -> None:
        self.timings.setdefault(stage, round(time.monotonic() - self.started, 6))

    def _stamp(self, moment: str) -> None:
        """A moment only the TTFT stages use (:func:`router.dispatch.timeline.ttft_stages`)."""
        self._stamps.setdefault(moment, time.monotonic() - self.started)

    # ---- passive health and admission -------------------------------------------------------

    def _leg_failed(self, backend: BackendState, exc: UpstreamError) -> None:
        """Feed a leg's failure to its instance's breaker (a 4xx is not the instance's fault)."""
        if exc.instance_fault and backend.breaker.record_failure(exc.message, trip=exc.unreachable):
            log.warning("%s %s taken out by its breaker: %s", backend.role, backend.label, exc)
            m = self.runtime.metrics
            m.child(m.breaker_open, backend.role, backend.label).set(1)

    def _leg_ok(self, backend: BackendState) -> None:
        if not backend.breaker.closed or backend.breaker.failures:
            backend.breaker.record_success()
            m = self.runtime.metrics
            m.child(m.breaker_open, backend.role, backend.label).set(0)

    async def _admit(self) -> None:
        """An admission slot on every leg's instance; no leg holds one while waiting for another.

        All slots are taken in one step (no await in between) once every instance has room.
        While one is full this waits in that instance's queue holding nothing; with its slot, it
        takes the others if they have room, else gives the slot back and waits for the one now
        full. The whole wait is bounded by ``admission.max_wait``; :class:`Overloaded` (counted
        and worded against the full instance) beyond it or beyond a full queue.
        """
        backends = list(self._counted.values())
        start = time.monotonic()
        while True:
            full = next((b for b in backends if not b.gate.has_room()), None)
            if full is None:
                break
            waited = time.monotonic() - start
            slot = await self._queue_for(full, full.gate.config.max_wait - waited)
            if all(b.gate.has_room() for b in backends if b is not full):
                self._slots[full.role] = slot
                break
            slot.release()
        for backend in backends:
            if backend.role not in self._slots:
                self._slots[backend.role], _ = await backend.gate.acquire(backend.label)
            m = self.runtime.metrics
            m.child(m.admission_wait, backend.role).observe(time.monotonic() - start)

    async def _queue_for(self, backend: BackendState, max_wait: float) -> Slot:
        """Wait (at most ``max_wait``) in the queue of ``backend``, which has no free slot."""
        m = self.runtime.metrics
        queue = m.child(m.admission_queue, backend.role, backend.label)
        queue.inc()
        try:
            slot, _ = await backend.gate.acquire(backend.label, max_wait)
        except RouterError:
            m.child(m.admission_rejected, backend.role, backend.label).inc()
            raise
        finally:
            queue.dec()
        return slot

    # ---- legs -------------------------------------------------------------------------------

    def _show_in_flight(self, backend: BackendState) -> None:
        m = self.runtime.metrics
        m.child(m.in_flight, backend.role, backend.label).set(backend.in_flight)

    def _uncount(self, role: Role) -> None:
        """Give back the in-flight count of ``role``'s leg (idempotent): when the leg ends, or
        at ``close()`` for a leg that never ran."""
        backend = self._counted.pop(role, None)
        if backend is not None:
            backend.in_flight -= 1
            self._show_in_flight(backend)

    @contextmanager
    def _track(self, backend: BackendState) -> Iterator[Span]:
        """Around one leg: its trace span; after it, its in-flight count (taken when its pool
        chose it) and its admission slot are given back."""
        span = self.ctx.trace.child(
            backend.role, span_attributes(backend=backend.label, request_id=self.request_id)
        )
        error: str | None = "cancelled"
        try:
            yield span
            error = None
        except RouterError as exc:
            error = exc.message
            raise
        finally:
            span.end(error)
            self._uncount(backend.role)
            slot = self._slots.get(backend.role)
            if slot is not None:
                slot.release()

    async def _prefill_leg(self, prefill: BackendState) -> dict[str, Any]:
        """P leg: 1 token, not streamed; returns P's answer after checking its kv params."""
        t = self.runtime.settings.timeouts
        body = prefill_body(self.request.body, self.request.chat, self.transfer_id)
        outcome = "error"
        start = time.monotonic()
        self._stamp("prefill_sent")
        try:
            with self._track(prefill) as span:
                try:
                    async with asyncio.timeout(t.prefill):
                        data = await post_json(
                            self.runtime.client,
                            prefill,
                            "prefill",
                            self.request.path,
                            body,
                            self.request_id,
                            span.headers(),
                        )
                except TimeoutError as exc:
                    outcome = "timeout"
                    raise UpstreamTimeout(
                        "prefill", prefill.label, f"no answer within {t.prefill:g}s"
                    ) from exc
            self._check_prefill_answer(prefill, data)
            self._leg_ok(prefill)
            self._mark("prefill_done")
            outcome = "ok"
            log.debug(
                "dispatch %s: prefill %s answered in %.3fs",
                self.request_id,
                prefill.label,
                time.monotonic() - start,
            )
            return data
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except UpstreamError as exc:
            self._leg_failed(prefill, exc)
            raise
        finally:
            m = self.runtime.metrics
            m.child(m.prefill_duration, prefill.label, outcome).observe(time.monotonic() - start)

    def _check_prefill_answer(self, prefill: BackendState, data: dict[str, Any]) -> None:
        kv = data.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise UpstreamProtocolError(
                "prefill",
                prefill.label,
                "answer has no kv_transfer_params (is a NIXL KV connector configured?)",
            )
        if self._sent_identity is None:
            return
        try:
            answered = identity_from_kv(kv)
        except ValueError as exc:
            raise UpstreamProtocolError("prefill", prefill.label, str(exc)) from exc
        sent = self._sent_identity.engine_id
        if answered.engine_id == sent:
            return
        if prefill.config.identity is not None:
            raise UpstreamProtocolError(
                "prefill",
                prefill.label,
                f"configured engine_id {sent} does not match the instance's "
                f"{answered.engine_id}; fix the router config",
            )
        learn_identity(self.runtime, prefill, answered)
        raise UpstreamProtocolError(
            "prefill",
            prefill.label,
            f"engine id changed from {sent} to {answered.engine_id}; "
            "the decode leg was paired with the old one",
        )

    async def _decode_leg(self) -> None:
        """D leg: puts SSE payloads (or the one JSON answer), then ``_END`` or an error."""
        try:
            body = await self._decode_body()
            start = time.monotonic()
            self._stamp("decode_sent")
            m = self.runtime.metrics
            first = m.child(m.decode_first_token, self.decode.label)
            args = (self.runtime.client, self.decode, "decode", self.request.path, body)
            with self._track(self.decode) as span:
                if self.request.stream:
                    async with open_sse(*args, self.request_id, span.headers()) as payloads:
                        async for payload in payloads:
                            self._last_token = time.monotonic()
                            if start:
                                first.observe(self._last_token - start)
                                start = 0.0
                            self._queue.put_nowait(payload)
                    self._leg_ok(self.decode)  # a stream succeeded when it ended cleanly
                else:
                    answer = await post_json(*args, self.request_id, span.headers())
                    first.observe(time.monotonic() - start)
                    self._leg_ok(self.decode)
                    self._queue.put_nowait(answer)
            self._queue.put_nowait(_END)
        except RouterError as exc:
            # In pull mode D's body waits for P: P's error surfaces here too, and is P's fault.
            if isinstance(exc, UpstreamError) and exc.leg == "decode":
                self._leg_failed(self.decode, exc)
            self._queue.put_nowait(exc)

    async def _decode_body(self) -> dict[str, Any]:
        if self.prefill is None:
            return strip_client_fields(self.request.body)
        if self._sent_identity is not None:
            return decode_body_push(
                self.request.body, self._sent_identity, self.request_id, self.transfer_id
            )
        assert self._p_task is not None
        answer = await asyncio.shield(self._p_task)
        return decode_body_pull(self.request.body, answer["kv_transfer_params"], self.transfer_id)

    # ---- commit point -----------------------------------------------------------------------

    async def open(self) -> None:
        """Start both legs and wait for D's first token (the commit point).

        Raises the failing leg's error if P fails first or D fails before its first token, and
        :class:`UpstreamTimeout` if the first token does not come in time. The caller must call
        ``close()`` in every case.
        """
        settings = self.runtime.settings
        prefill = self.prefill
        if settings.mode == "push" and prefill is not None:
            self._sent_identity = prefill.identity
            if self._sent_identity is None:
                raise NoBackendAvailable(f"prefill {prefill.label} has no known identity")
        log.debug(
            "dispatch %s: %s %s prefill=%s (engine %s) decode=%s",
            self.request_id,
            settings.mode,
            self.request.path,
            prefill.label if prefill is not None else "-",
            self._sent_identity.engine_id if self._sent_identity else "-",
            self.decode.label,
        )
        self.runtime.lifecycle.enter(self)
        await self._admit()
        self._mark("admitted")
        first_token = self.ctx.trace.child("first_token", {"request_id": self.request_id})
        try:
            await self._until_first_token()
        except RouterError as exc:
            first_token.end(exc.message)
            raise
        first_token.end()

    def abort(self, reason: str) -> None:
        """End this dispatch early (router stopping): its client gets an error now, before or
        after the commit point; the legs are cancelled by ``close()`` as always."""
        self._queue.put_nowait(RouterNotReady(reason))

    async def _until_first_token(self) -> None:
        settings = self.runtime.settings
        prefill = self.prefill
        if prefill is not None:
            self._p_task = asyncio.create_task(self._prefill_leg(prefill))
        self._d_task = asyncio.create_task(self._decode_leg())
        t = settings.timeouts
        first_token_by = self.started + t.first_token if self.request.stream else self.deadline
        deadline = min(first_token_by, self.deadline)
        limit = t.first_token if deadline < self.deadline else t.total
        get = asyncio.create_task(self._queue.get())
        waiting: set[asyncio.Future[Any]] = {get}
        if self._p_task is not None:
            waiting.add(self._p_task)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    p_busy = self._p_task is not None and not self._p_task.done()
                    backend = prefill if p_busy and prefill is not None else self.decode
                    leg = "prefill" if backend is prefill else "decode"
                    exc = UpstreamTimeout(leg, backend.label, f"no first token within {limit:g}s")
                    self._leg_failed(backend, exc)
                    raise exc
                done, _ = await asyncio.wait(
                    waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if self._p_task is not None and self._p_task in done:
                    waiting.discard(self._p_task)
                    p_exc = self._p_task.exception()
                    if p_exc is not None:
                        raise p_exc
                if get in done:
                    item = get.result()
                    if isinstance(item, RouterError):
                        raise item
                    self._first = item
                    self._mark("first_token")
                    log.debug(
                        "dispatch %s: first token after %.3fs",
                        self.request_id,
                        time.monotonic() - self.started,
                    )
                    return
        finally:
            get.cancel()

    # ---- relay ------------------------------------------------------------------------------

    async def _prefill_usage(self) -> Any:
        """P's usage, waiting for P (bounded by the total timeout); None if P failed."""
        if self._p_task is None:
            return None
        left = self.deadline - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.0)):
                answer = await asyncio.shield(self._p_task)
        except (RouterError, TimeoutError):
            return None
        return prefill_usage(answer)

    async def _client_event(self, payload: str) -> bytes:
        if '"usage"' in payload:
            try:
                chunk = codec.loads(payload)
            except ValueError:
                chunk = None
            if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
                chunk["usage"] = merge_usage(chunk["usage"], await self._prefill_usage())
                return b"data: " + codec.dumps(chunk) + b"\n\n"
        return b"data: " + payload.encode() + b"\n\n"

    async def sse_events(self) -> AsyncGenerator[bytes, None]:
        """Client SSE bytes from the first token on; a later failure ends it with one error event.

        What D has already sent goes out in one write (the events of one upstream read arrive
        together); nothing waits for more, so the client sees every event as soon as it would
        alone. Sets ``outcome`` before it yields the stream's last chunk, and only then (the
        response ends the body with that chunk). Never raises :class:`RouterError` (headers are
        already sent).
        """
        left = self.deadline - time.monotonic()
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(max(left, 0.0), self._expire)
        self._stall_timer = loop.call_later(self.runtime.settings.timeouts.inter_token, self._stall)
        item: DecodeItem | None = self._first
        try:
            while True:
                events, item = await self._ready_events(item)
                end = self._end_event(item)
                if events or end is not None:
                    yield b"".join(events if end is None else [*events, end])
                if events and "client_first" not in self._stamps:
                    self._observe_ttft_stages()
                if end is not None:
                    return
                if not isinstance(item, str):
                    item = await self._queue.get()
        finally:
            expiry.cancel()
            if self._stall_timer is not None:
                self._stall_timer.cancel()

    async def _ready_events(self, item: DecodeItem | None) -> tuple[list[bytes], DecodeItem | None]:
        """Client events for ``item`` and the payloads queued behind it; returns them with the
        first item not taken (None: the queue is empty). A usage chunk may wait for P's answer,
        so it starts a batch of its own: the events before it are not held back."""
        batch: list[bytes] = []
        while isinstance(item, str):
            if batch and '"usage"' in item:
                break
            batch.append(await self._client_event(item))
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                item = None
        return batch, item

    def _end_event(self, item: DecodeItem | None) -> bytes | None:
        """The stream's last event if ``item`` ends it (sets ``outcome``); None otherwise."""
        if isinstance(item, _End):
            self.outcome = "ok"
            return b"data: [DONE]\n\n"
        if isinstance(item, RouterError):
            self.outcome = "decode_failed_midstream"
            log.warning("dispatch %s failed mid-stream: %s", self.request_id, item.message)
            return sse_error_event(item)
        return None

    def _expire(self) -> None:
        """The relay's one timer: at the total timeout, queue the error that ends the stream
        (no timer per awaited token; what D queued before it is still relayed)."""
        limit = self.runtime.settings.timeouts.total
        self._queue.put_nowait(
            UpstreamTimeout("decode", self.decode.label, f"total {limit:g}s exceeded")
        )

    def _stall(self) -> None:
        """The relay's stall timer: D sent nothing for ``timeouts.inter_token`` since its last
        payload: queue the error that ends the stream, count it against D's breaker. Re-arms
        itself for the rest of the period while D is sending (one timer per period, not one per
        token); does nothing once D's leg has ended."""
        limit = self.runtime.settings.timeouts.inter_token
        if self._d_task is None or self._d_task.done():
            return
        idle = time.monotonic() - self._last_token
        if idle < limit:
            loop = asyncio.get_running_loop()
            self._stall_timer = loop.call_later(limit - idle, self._stall)
            return
        exc = UpstreamTimeout(
            "decode", self.decode.label, f"no token for {limit:g}s (timeouts.inter_token)"
        )
        log.warning("dispatch %s: decode %s stalled mid-stream", self.request_id, self.decode.label)
        self.runtime.metrics.stream_stalls.inc()
        self._leg_failed(self.decode, exc)
        self._queue.put_nowait(exc)

    async def json_response(self) -> dict[str, Any]:
        """The non-streamed answer for the client (after ``open()``), usage merged."""
        if not isinstance(self._first, dict):
            raise UpstreamProtocolError("decode", self.decode.label, "unexpected streamed answer")
        self.outcome = "ok"
        answer = client_response(self._first, await self._prefill_usage())
        self._observe_ttft_stages()
        return answer

    def _observe_ttft_stages(self) -> None:
        """Record the TTFT stages once the first answer byte is on its way to the client."""
        self._stamp("client_first")
        m = self.runtime.metrics
        for stage, seconds in ttft_stages({**self.timings, **self._stamps}).items():
            m.child(m.ttft_stage, stage).observe(seconds)

    async def close(self) -> None:
        """Cancel whatever leg still runs and wait for it to unwind (idempotent).

        After a successful answer the P leg is drained first (its answer can arrive after D's
        last token in push mode), bounded by what is left of the prefill timeout; reading it to
        the end also keeps the connection to P reusable.
        """
        p_task = self._p_task
        if self.outcome == "ok" and p_task is not None and not p_task.done():
            left = self.started + self.runtime.settings.timeouts.prefill - time.monotonic()
            if left > 0:
                await asyncio.wait({p_task}, timeout=left)
        tasks = [t for t in (self._d_task, self._p_task) if t is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for slot in self._slots.values():
            slot.release()
        for role in list(self._counted):
            self._uncount(role)
        self.runtime.lifecycle.leave(self)
        p_result = results[-1] if self._p_task is not None else None
        if isinstance(p_result, UpstreamError) and self.outcome == "ok":
            log.warning("dispatch %s: prefill failed after commit: %s", self.request_id, p_result)
