"""Chooses the route and the instances for a client request, opens the dispatch, retries once if
configured.

Who calls it: the app's generation endpoints. The request's ``model`` picks its pools and its
disaggregation rule from the current routing table (read once: a reload during the request does
not move it). The rule decides whether a P is used at all (:func:`decide`); P (if any) and D are
both chosen before any leg starts. A retry happens only when ``retry_on_fresh_pair`` is set (the
default), the failure is retryable (not a 4xx from vLLM) and nothing has been sent to the client
yet (we are still before the commit point); the retry never re-picks the instance that failed,
whatever the policy (no other usable instance: the first failure is the answer, and no retry is
logged or counted), and uses a fresh request id. Every attempt shares one ``timeouts.total``
deadline, counted from the first attempt: a retry does not restart it. The decision is counted in
``disagg_router_routing_decisions_total`` and logged.
"""

from __future__ import annotations

import logging
import time

from router.dispatch.attempt import Dispatch
from router.errors import NoBackendAvailable, UpstreamError
from router.http.context import RequestContext
from router.http.validation import ClientRequest
from router.routing.policies import RoutingInput
from router.routing.prompt_keys import estimated_tokens
from router.routing.table import ModelPools
from router.runtime import Runtime

log = logging.getLogger(__name__)

DISAGGREGATED = "disaggregated"
SHORT_PROMPT = "decode_only_short_prompt"
NO_PREFILL = "decode_only_no_prefill"


def decide(found: ModelPools, routed: RoutingInput) -> str:
    """How to serve a request: with a P leg, or by D alone (short prompt; no usable P)."""
    rule = found.route.disaggregation
    short = estimated_tokens(routed.prompt, rule.chars_per_token) < rule.min_prompt_tokens
    if rule.min_prompt_tokens and short:
        return SHORT_PROMPT
    if rule.when_no_prefill == "decode_only" and not found.prefill.usable():
        return NO_PREFILL
    return DISAGGREGATED


async def open_dispatch(
    runtime: Runtime, request: ClientRequest, ctx: RequestContext | None = None
) -> Dispatch:
    """An opened dispatch (first token in hand); the caller must ``close()`` it.

    Raises the last attempt's :class:`RouterError`; failed attempts are closed here.
    ``ctx``: the client request's ids; the first attempt uses ``ctx.request_id``.
    """
    ctx = ctx or RequestContext()
    found = runtime.model(request.model)
    routed = RoutingInput(request.body, request.chat, request.headers)
    decision = decide(found, routed)
    runtime.metrics.child(runtime.metrics.routing_decisions, request.model, decision).inc()
    attempts = 2 if runtime.settings.retry_on_fresh_pair else 1
    deadline = time.monotonic() + runtime.settings.timeouts.total
    avoid: set[str] = set()
    failure: UpstreamError | None = None
    failed_id = ""
    for attempt in range(1, attempts + 1):
        strict = failure is not None
        prefill = None
        try:
            if decision == DISAGGREGATED:
                prefill = found.prefill.choose(avoid, routed, strict)
            decode = found.decode.choose(avoid, routed, strict)
        except NoBackendAvailable:
            if prefill is not None:
                prefill.in_flight -= 1  # counted by choose(); no dispatch takes it over
            if failure is not None:
                raise failure from None
            raise
        if failure is not None:
            log.warning(
                "dispatch %s failed before commit (%s); retrying on a fresh pair",
                failed_id,
                failure.message,
            )
            runtime.metrics.retries.inc()
        rid = ctx.request_id if attempt == 1 else None
        dispatch = Dispatch(runtime, request, prefill, decode, ctx, rid, deadline)
        log.info(
            "request %s model=%s route=%s prefill=%s decode=%s",
            dispatch.request_id,
            request.model,
            decision,
            prefill.label if prefill is not None else "-",
            decode.label,
        )
        opened = False
        try:
            await dispatch.open()
            opened = True
            return dispatch
        except UpstreamError as exc:
            if attempt == attempts or not exc.retryable:
                raise
            avoid.add(exc.backend)
            failure, failed_id = exc, dispatch.request_id
        finally:
            if not opened:
                await dispatch.close()
    raise AssertionError("unreachable")  # pragma: no cover
