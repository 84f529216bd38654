"""The two legs of one attempt: P's prefill (one token, not streamed) and D's decode.

Who calls it: :func:`disagg_router.router.dispatch.commit.until_first_token` runs each leg as a task
of its own. The P leg returns P's answer after checking its ``kv_transfer_params``; the D leg puts
what D sends on the attempt's queue (SSE events as they are read, or the one JSON answer), then
``END`` or the error that ended it, and never raises a :class:`RouterError`. In push mode D's body
carries the P identity it was paired with and goes out at once; in pull mode it waits for P's
answer. Each leg's outcome feeds its instance's breaker (a 4xx is the client's fault, not the
instance's); a stream counts as D's success only when it ended cleanly. Neither leg waits without a
bound: P's by ``timeouts.prefill``, D's by the commit point's and the relay's timers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from disagg_router.router.dispatch.binding import bind_decode
from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.state import END, Attempt
from disagg_router.router.errors import (
    RouterError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from disagg_router.router.instances.identity import learn_identity
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.tracing import NO_SPAN, Span, span_attributes
from disagg_router.router.runtime import Runtime
from disagg_router.router.upstream.calls import open_sse, post_json
from disagg_router.router.upstream.rewrite import (
    decode_body_pull,
    decode_body_push,
    identity_from_kv,
    prefill_body,
    prefill_usage,
    strip_client_fields,
    with_prompt_ids,
)

log = logging.getLogger(__name__)


def leg_failed(runtime: Runtime, backend: BackendState, exc: UpstreamError) -> None:
    """Feed a leg's failure to its instance's breaker (a 4xx is not the instance's fault)."""
    if exc.instance_fault and backend.breaker.record_failure(exc.message, trip=exc.unreachable):
        log.warning("%s %s taken out by its breaker: %s", backend.role, backend.label, exc)
        m = runtime.metrics
        m.child(m.breaker_open, backend.role, backend.label).set(1)


def leg_ok(runtime: Runtime, backend: BackendState) -> None:
    """Feed a leg's success to its instance's breaker."""
    if not backend.breaker.closed or backend.breaker.failures:
        backend.breaker.record_success()
        m = runtime.metrics
        m.child(m.breaker_open, backend.role, backend.label).set(0)


class _Tracked:
    """Around one leg: its trace span; after it, its in-flight count and slot are given back.
    A class, not a generator context manager: it runs twice per request."""

    def __init__(self, attempt: Attempt, holds: Holds, backend: BackendState) -> None:
        self._holds = holds
        self._role = backend.role
        trace = attempt.ctx.trace
        self._span = trace  # tracing off: the no-op span is its own child, no attributes built
        if trace is not NO_SPAN:
            attributes = span_attributes(backend=backend.label, request_id=attempt.request_id)
            self._span = trace.child(backend.role, attributes)

    def __enter__(self) -> Span:
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        if kind is None:
            error = None
        elif isinstance(exc, RouterError):
            error = exc.message
        else:
            error = "cancelled"
        self._span.end(error)
        self._holds.release(self._role)


async def prefill_leg(attempt: Attempt, holds: Holds, prefill: BackendState) -> dict[str, Any]:
    """P leg: 1 token, not streamed; P's answer once its kv params are checked."""
    outcome = "error"
    start = time.monotonic()
    attempt.stamp("prefill_sent")
    limit = attempt.runtime.settings.timeouts.prefill
    attempt.p_ticket = prefill.pace.prefill.send(attempt.prompt_tokens, start)
    try:
        with _Tracked(attempt, holds, prefill) as span:
            try:
                data = await _post_prefill(attempt, prefill, span, limit)
            except TimeoutError as exc:
                outcome = "timeout"
                raise UpstreamTimeout(
                    "prefill", prefill.label, f"no answer within {limit:g}s"
                ) from exc
        check_prefill_answer(attempt, prefill, data)
        _count_failover_prefill(attempt, data)
        leg_ok(attempt.runtime, prefill)
        attempt.mark("prefill_done")
        outcome = "ok"
        if log.isEnabledFor(logging.DEBUG):
            took = time.monotonic() - start
            log.debug(
                "dispatch %s: prefill %s answered in %.3fs", attempt.request_id, prefill.label, took
            )
        return data
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except UpstreamError as exc:
        leg_failed(attempt.runtime, prefill, exc)
        raise
    finally:
        now = time.monotonic()
        m = attempt.runtime.metrics
        m.child(m.prefill_duration, prefill.label, outcome).observe(now - start)
        _prefill_ended(attempt, prefill, now, outcome == "ok")


def _prefill_ended(attempt: Attempt, prefill: BackendState, now: float, answered: bool) -> None:
    """Close the P leg's ticket in P's pace (``answered``: P's answer came, which teaches P's
    speed) and observe how far the finish was from the prediction."""
    ticket, attempt.p_ticket = attempt.p_ticket, None
    attempt.prefill_answered = answered
    if ticket is None:
        return
    error = prefill.pace.prefill.done(ticket, now, answered)
    if error is not None:
        m = attempt.runtime.metrics
        m.child(m.prefill_finish_error, "late" if error > 0 else "early").observe(abs(error))


def _count_failover_prefill(attempt: Attempt, data: dict[str, Any]) -> None:
    """Observe (and log) the prompt tokens P computed for an attempt after a D failure: its
    prompt less what P's prefix cache served (vLLM's ``remote_prefill_cached_tokens``)."""
    phase = attempt.failover
    usage = prefill_usage(data)
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if phase is None or not isinstance(prompt, int) or not isinstance(cached, int):
        return
    m = attempt.runtime.metrics
    m.child(m.failover_prefill_tokens, phase).observe(prompt - cached)
    log.info(
        "dispatch %s (after a D failure, %s): P computed %d of %d prompt tokens",
        attempt.request_id,
        phase,
        prompt - cached,
        prompt,
    )


async def _post_prefill(
    attempt: Attempt, prefill: BackendState, span: Span, limit: float
) -> dict[str, Any]:
    """P's answer within ``limit`` seconds (:class:`TimeoutError` after it)."""
    request = attempt.request
    body = prefill_body(request.body, request.chat, attempt.transfer_id)
    body = with_prompt_ids(body, request.prompt_ids)
    async with asyncio.timeout(limit):
        return await post_json(
            attempt.runtime.client,
            prefill,
            "prefill",
            attempt.request.path,
            body,
            attempt.request_id,
            span.headers(),
        )


def check_prefill_answer(attempt: Attempt, prefill: BackendState, data: dict[str, Any]) -> None:
    """:class:`UpstreamProtocolError` unless P's answer carries ``kv_transfer_params`` and (push
    mode) names the engine D was paired with; a changed engine id is learned for later pairs."""
    kv = data.get("kv_transfer_params")
    if not isinstance(kv, dict):
        raise UpstreamProtocolError(
            "prefill",
            prefill.label,
            "answer has no kv_transfer_params (is a NIXL KV connector configured?)",
        )
    if attempt.sent_identity is None:
        return
    try:
        answered = identity_from_kv(kv, attempt.sent_identity)
    except ValueError as exc:
        raise UpstreamProtocolError("prefill", prefill.label, str(exc)) from exc
    sent = attempt.sent_identity.engine_id
    if answered.engine_id == sent:
        return
    if prefill.config.identity is not None:
        raise UpstreamProtocolError(
            "prefill",
            prefill.label,
            f"configured engine_id {sent} does not match the instance's "
            f"{answered.engine_id}; fix the router config",
        )
    learn_identity(prefill, answered, attempt.runtime.metrics)
    raise UpstreamProtocolError(
        "prefill",
        prefill.label,
        f"engine id changed from {sent} to {answered.engine_id}; "
        "the decode leg was paired with the old one",
    )


async def decode_leg(attempt: Attempt, holds: Holds) -> None:
    """D leg: queues D's events (or its one JSON answer), then ``END`` or the error. D bound
    late (push.bind) is chosen first, when due (:func:`bind_decode`)."""
    decode = attempt.decode
    try:
        if attempt.choose_decode is not None:
            await bind_decode(attempt, holds)
            decode = attempt.decode
        body = await _decode_body(attempt)
        attempt.stamp("decode_sent")
        with _Tracked(attempt, holds, decode) as span:
            if attempt.request.stream:
                await _relay_stream(attempt, body, span)
            else:
                await _one_answer(attempt, body, span)
        leg_ok(attempt.runtime, decode)  # a stream succeeded only once it ended cleanly
        attempt.queue.put_nowait(END)
    except RouterError as exc:
        # In pull mode D's body waits for P: P's error surfaces here too, and is P's fault.
        if isinstance(exc, UpstreamError) and exc.leg == "decode":
            leg_failed(attempt.runtime, decode, exc)
        attempt.queue.put_nowait(exc)


async def _relay_stream(attempt: Attempt, body: dict[str, Any], span: Span) -> None:
    """Queue the SSE events of D's stream as they are read, noting when they came."""
    runtime, decode = attempt.runtime, attempt.decode
    first = runtime.metrics.child(runtime.metrics.decode_first_token, decode.label)
    start = time.monotonic()
    args = (runtime.client, decode, "decode", attempt.request.path, body)
    async with open_sse(*args, attempt.request_id, span.headers()) as reads:
        decode.pace.decode.observe(time.monotonic() - start)  # D accepted it: its lead
        attempt.reader = reads  # the relay may splice it to the client while it waits
        try:
            async for events in reads:
                attempt.last_token = time.monotonic()
                if start:
                    first.observe(attempt.last_token - start)
                    start = 0.0
                attempt.queue.put_nowait(events)
        finally:
            attempt.reader = None


async def _one_answer(attempt: Attempt, body: dict[str, Any], span: Span) -> None:
    """Queue D's whole (non-streamed) answer."""
    runtime, decode = attempt.runtime, attempt.decode
    start = time.monotonic()
    args = (runtime.client, decode, "decode", attempt.request.path, body)
    answer = await post_json(*args, attempt.request_id, span.headers())
    runtime.metrics.child(runtime.metrics.decode_first_token, decode.label).observe(
        time.monotonic() - start
    )
    attempt.queue.put_nowait(answer)


async def _decode_body(attempt: Attempt) -> dict[str, Any]:
    """D's body: the client's (D alone), with P's identity (push) or with P's answer (pull);
    a continuation's prompt ids with it (:func:`with_prompt_ids`)."""
    request = attempt.request
    if attempt.prefill is None:
        body = strip_client_fields(request.body)
    elif attempt.sent_identity is not None:
        body = decode_body_push(
            request.body, attempt.sent_identity, attempt.request_id, attempt.transfer_id
        )
    else:
        assert attempt.p_task is not None
        answer = await asyncio.shield(attempt.p_task)
        kv = answer["kv_transfer_params"]
        body = decode_body_pull(request.body, kv, attempt.transfer_id)
    return with_prompt_ids(body, request.prompt_ids)
