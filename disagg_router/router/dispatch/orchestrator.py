"""Chooses the route and the instances for a client request, opens the dispatch, retries once if
configured.

Who calls it: the app's generation endpoints (:mod:`disagg_router.router.http.generate`). The
request's ``model`` picks its pools and its disaggregation rule from the current routing table (read
once: a reload during the request does not move it). The rule decides whether a P is used at all
(:func:`decide`); P (if any) and D are both chosen before any leg starts, each counted in flight by
its pool, as a pair the KV connector can serve
(:func:`disagg_router.router.routing.pairing.choose_pair`: pairs whose learned shapes it refuses are
skipped; with none served, a 503 names the reason). Retries
(:mod:`disagg_router.router.dispatch.retry`, the one loop pass-through requests use too) happen only
when ``retry_on_fresh_pair`` is set (the default), the failure is retryable (not a 4xx from vLLM)
and nothing has been sent to the client yet (we are still before the commit point); the retry never
re-picks the instance that failed, whatever the policy, and uses a fresh request id. When D's leg
broke without an answer (D unreachable, its connection lost, or silent past its timeout: D died or
hangs), the retry keeps the attempt's P (while it is usable and pairs with another D), whatever the
policy: that P has computed, or is computing, the prompt's KV, which vLLM's prefix cache (on by
default) can serve the retry from, where another P would prefill the whole prompt again; a prefill
still running is let finish first, not cancelled. In push mode with ``push.bind`` just in time
(or adaptive, when D's KV is scarce) the D chosen with P is a stand-in: the attempt chooses its D
when D's leg is due (:mod:`disagg_router.router.dispatch.binding`). Every
attempt shares one ``timeouts.total`` deadline, counted from the first attempt: a retry does not
restart it. The decision is counted in ``disagg_router_routing_decisions_total`` and logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from disagg_router.router.dispatch.attempt import Dispatch
from disagg_router.router.dispatch.binding import binds_late, count_eager
from disagg_router.router.dispatch.retry import first_that_opens
from disagg_router.router.dispatch.state import Attempt
from disagg_router.router.errors import UpstreamError, UpstreamHTTPError, UpstreamProtocolError
from disagg_router.router.instances.state import BackendState
from disagg_router.router.request import ClientRequest, RequestContext
from disagg_router.router.routing.pairing import choose_decode_for, choose_pair, choose_prefill
from disagg_router.router.routing.policies.base import RoutingInput
from disagg_router.router.routing.prompt_keys import estimated_tokens
from disagg_router.router.routing.table import ModelPools
from disagg_router.router.runtime import Runtime

log = logging.getLogger(__name__)

DISAGGREGATED = "disaggregated"
SHORT_PROMPT = "decode_only_short_prompt"
NO_PREFILL = "decode_only_no_prefill"
CACHED_ON_DECODE = "decode_only_cached"


@dataclass(frozen=True)
class Resume:
    """A stream that goes on after its D failed mid-stream
    (:mod:`disagg_router.router.dispatch.migration`): that failure, every instance that failed
    the request so far (never chosen again), the failed attempt's P (kept, as after a D that
    went away before the first token) and the request's deadline (not restarted)."""

    failed: UpstreamError
    avoid: frozenset[str]
    prefill: BackendState | None
    deadline: float


def decide(found: ModelPools, routed: RoutingInput) -> str:
    """How to serve a request: with a P leg, or by D alone (short prompt; a D holds most of
    the prompt in its KV cache, ``kv_events.decode_only_fraction``; no usable P)."""
    rule = found.route.disaggregation
    short = estimated_tokens(routed.prompt, rule.chars_per_token) < rule.min_prompt_tokens
    if rule.min_prompt_tokens and short:
        return SHORT_PROMPT
    if routed.kv is not None and routed.kv.decode_holds(found.decode.usable()):
        return CACHED_ON_DECODE
    if rule.when_no_prefill == "decode_only" and not found.prefill.usable():
        return NO_PREFILL
    return DISAGGREGATED


async def open_dispatch(
    runtime: Runtime,
    request: ClientRequest,
    ctx: RequestContext | None = None,
    resume: Resume | None = None,
) -> Dispatch:
    """An opened dispatch (first token in hand); the caller must ``close()`` it.

    Raises the last attempt's :class:`RouterError`; failed attempts are closed here.
    ``ctx``: the client request's ids; the first attempt uses ``ctx.request_id``. ``resume``:
    the request continues a stream whose D failed (its first attempt is chosen as a retry after
    that failure is).
    """
    ctx = ctx or RequestContext()
    found = runtime.model(request.model)
    kv = runtime.kv.request(request.model, request.body, request.chat)
    routed = RoutingInput(request.body, request.chat, request.headers, kv)
    decision = decide(found, routed)
    runtime.metrics.child(runtime.metrics.routing_decisions, request.model, decision).inc()
    total = runtime.settings.timeouts.total
    deadline = resume.deadline if resume is not None else time.monotonic() + total
    before = resume.avoid if resume is not None else frozenset()
    last_prefill = resume.prefill if resume is not None else None  # the last attempt's P
    pending = resume.failed if resume is not None else None  # the failure the 1st choice follows
    failover: str | None = None  # the phase of the D failure the chosen pair follows
    tokens = len(request.prompt_ids) if request.prompt_ids else _tokens(found, routed)
    late = decision == DISAGGREGATED and resume is None  # D bound late, if push.bind says so
    late = late and binds_late(runtime.settings, found.decode, tokens)
    choice: tuple[frozenset[str], bool] = (frozenset(), False)  # the choice's avoid, strict

    def choose(
        avoid: set[str], failed: UpstreamError | None
    ) -> tuple[BackendState | None, BackendState]:
        nonlocal last_prefill, pending, failover, choice
        phase = "after_first_token" if pending is not None else "before_first_token"
        failed, pending = failed or pending, None
        gone = _d_went_away(failed)
        keep = last_prefill if gone else None
        choice = (frozenset(avoid | before), failed is not None)
        pair = _choose_pair(found, decision, routed, choice[0], choice[1], keep, late)
        last_prefill = pair[0]
        failover = phase if gone else None
        if gone:
            kept = "kept" if keep is not None and pair[0] is keep else "other"
            m = runtime.metrics
            m.child(m.decode_failovers, phase, kept).inc()
        return pair

    retries_left = 1 if runtime.settings.retry_on_fresh_pair else 0

    async def open_attempt(
        pair: tuple[BackendState | None, BackendState], request_id: str
    ) -> Dispatch:
        nonlocal retries_left
        attempt = Attempt(runtime, request, *pair, ctx, request_id, deadline)
        attempt.failover = failover
        attempt.prompt_tokens = tokens
        attempt.kv_demand = found.decode.kv_demand
        if pair[0] is not None and runtime.settings.mode == "push":
            if late:
                _bind_late(attempt, pair[0], found, routed, *choice)
            else:
                count_eager(runtime.metrics)
        dispatch = Dispatch(attempt)
        _log_attempt(dispatch, request, decision)
        retry_follows, retries_left = retries_left > 0, retries_left - 1
        await _open(dispatch, retry_follows)
        return dispatch

    return await first_that_opens(runtime, "dispatch", ctx.request_id, choose, open_attempt)


async def _open(dispatch: Dispatch, retry_follows: bool) -> None:
    """``dispatch.open()``; a dispatch that failed to open is closed before the error goes on.
    When D went away and a retry follows (which keeps P), P's prefill is let finish first: the
    retry then finds the whole prompt in P's prefix cache."""
    opened = False
    try:
        await dispatch.open()
        opened = True
    except UpstreamError as exc:
        if retry_follows and _d_went_away(exc):
            await dispatch.let_prefill_finish()
        raise
    finally:
        if not opened:
            await dispatch.close()


def _d_went_away(failed: UpstreamError | None) -> bool:
    """Whether ``failed`` is D's leg breaking without an answer (unreachable, connection lost,
    timed out: D died or hangs), after which the retry keeps P. An error D answered (a 5xx,
    e.g. a KV transfer that failed) may be P's doing, so that retry takes a fresh pair."""
    return (
        failed is not None
        and failed.leg == "decode"
        and not isinstance(failed, UpstreamHTTPError | UpstreamProtocolError)
    )


def _choose_pair(
    found: ModelPools,
    decision: str,
    routed: RoutingInput,
    avoid: Collection[str],
    strict: bool,
    keep: BackendState | None = None,
    late: bool = False,
) -> tuple[BackendState | None, BackendState]:
    """P (None: D alone) and D for one attempt, each counted in flight by its pool; when D
    cannot be chosen, P's count is given back before :class:`NoBackendAvailable` propagates.
    ``keep``: the P to choose again if it is still usable and pairs with a D. ``late``: D is
    bound late; the D returned is an uncounted stand-in (:func:`choose_prefill`)."""
    if decision == DISAGGREGATED and late:
        return choose_prefill(found.prefill, found.decode, avoid, routed, strict, keep)
    if decision == DISAGGREGATED:
        return choose_pair(found.prefill, found.decode, avoid, routed, strict, keep)
    return None, found.decode.choose(avoid, routed, strict)


def _tokens(found: ModelPools, routed: RoutingInput) -> int:
    """The prompt's estimated tokens: P's pace predicts with them, D's KV demand holds them."""
    return estimated_tokens(routed.prompt, found.route.disaggregation.chars_per_token)


def _bind_late(
    attempt: Attempt,
    prefill: BackendState,
    found: ModelPools,
    routed: RoutingInput,
    avoid: frozenset[str],
    strict: bool,
) -> None:
    """Make ``attempt`` choose its D when its leg is due
    (:mod:`disagg_router.router.dispatch.binding`); its ``decode`` is a stand-in until then."""

    def choose() -> BackendState:
        return choose_decode_for(prefill, found.decode, avoid, routed, strict)

    attempt.choose_decode = choose


def _log_attempt(dispatch: Dispatch, request: ClientRequest, decision: str) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    late = dispatch.binds_late
    log.info(
        "request %s model=%s route=%s prefill=%s decode=%s",
        dispatch.request_id,
        request.model,
        decision,
        dispatch.prefill.label if dispatch.prefill is not None else "-",
        "(bound when due)" if late else dispatch.decode.label,
    )
