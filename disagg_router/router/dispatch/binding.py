"""Binding D late in push mode (``push.bind``): D chosen, and its leg sent, when P is about to
finish, not when the request arrives.

Who calls it: the orchestrator (:mod:`disagg_router.router.dispatch.orchestrator`) asks
:func:`binds_late` once per request; an attempt that binds late carries a chooser for D, and its
D leg (:mod:`disagg_router.router.dispatch.legs`) awaits :func:`bind_decode` before it sends
anything. The wait ends at P's predicted finish (:class:`~disagg_router.router.instances.pace.
PrefillPace`) less the longest learned lead of the usable Ds, ``push.lead_margin`` and P's own
margin (how early its prefills end against the binding's predictions), at once when P's speed is
not learned yet, and when P's prefill ends first. It is re-planned whenever a
prefill on that P ends (the queue ahead moved). D is then chosen with that moment's loads, counted
and admitted. Nothing here outlives the attempt: cancelling the D leg (the attempt's close, P's
failure, the client leaving) cancels the wait, with nothing bound and nothing to give back.
"""

from __future__ import annotations

import asyncio
import logging
import time

from disagg_router.router.config import RouterSettings
from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.state import Attempt
from disagg_router.router.errors import NoBackendAvailable
from disagg_router.router.instances.load import fresh_signals
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.metrics import RouterMetrics
from disagg_router.router.routing.pools import Pool

log = logging.getLogger(__name__)

EAGER = "eager"
JUST_IN_TIME = "just_in_time"


def binds_late(settings: RouterSettings, decodes: Pool, tokens: int) -> bool:
    """Whether a push dispatch of a ``tokens``-token prompt over the D pool ``decodes`` binds D
    late: ``just_in_time`` always; ``adaptive`` when D's KV is scarce (:func:`kv_scarce`)."""
    push = settings.push
    if settings.mode != "push" or push.bind == EAGER:
        return False
    if push.bind == JUST_IN_TIME:
        return True
    return kv_scarce(settings, decodes.usable(), decodes.kv_demand.tokens, tokens)


def kv_scarce(
    settings: RouterSettings, decodes: list[BackendState], in_flight: int, tokens: int
) -> bool:
    """Whether D's KV is scarce for a ``tokens``-token prompt: ``push.adaptive_kv_usage``
    reached by either figure of the usable Ds with fresh load signals.

    - One D's KV cache usage (vLLM's gauge; what other routers put there is in it).
    - The share of the Ds' KV caches (their sizes from the same scrapes) that ``in_flight``,
      the prompt tokens of this router's requests in flight on the pool, would hold if all were
      bound now, plus this prompt's share of the largest D. It does not swing with the binding
      it decides (blocks bound just in time leave the gauges low while the requests in P's
      queue would fill them), and a prompt that alone takes that share of a D, which an eager
      binding would keep from others through P's queue, is never bound eagerly.

    No fresh signals: not scarce (eager)."""
    now = time.monotonic()
    stale = settings.load_signals.stale_after
    fresh = [s for d in decodes if (s := fresh_signals(d, now, stale)) is not None]
    threshold = settings.push.adaptive_kv_usage
    if any(s.kv_usage >= threshold for s in fresh):
        return True
    sizes = [s.kv_tokens for s in fresh if s.kv_tokens > 0]
    if not sizes:
        return False
    return in_flight / sum(sizes) + tokens / max(sizes) >= threshold


def lead(settings: RouterSettings, decodes: list[BackendState]) -> float:
    """Seconds D's leg must go out before P finishes: the longest learned lead of ``decodes``
    (any may be chosen) plus ``push.lead_margin``."""
    longest = max((d.pace.decode.bound() for d in decodes), default=0.0)
    return longest + settings.push.lead_margin


async def bind_decode(attempt: Attempt, holds: Holds) -> None:
    """Wait for the bind moment, then choose D, take over its count and admit it
    (``attempt.decode`` is then the bound D). Raises what choosing or admitting D raises
    (:class:`~disagg_router.router.errors.NoBackendAvailable`,
    :class:`~disagg_router.router.errors.Overloaded`)."""
    assert attempt.choose_decode is not None and attempt.prefill is not None
    reason = await _until_due(attempt, attempt.prefill)
    decode = attempt.choose_decode()
    attempt.decode = decode
    attempt.choose_decode = None
    await holds.add(decode)
    _count(attempt.runtime.metrics, reason, time.monotonic() - attempt.started)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "dispatch %s: decode %s bound after %.3fs (%s)",
            attempt.request_id,
            decode.label,
            time.monotonic() - attempt.started,
            reason,
        )


def count_eager(metrics: RouterMetrics) -> None:
    """A push dispatch that bound D with P (its D leg goes out at once)."""
    _count(metrics, EAGER, 0.0)


def _count(metrics: RouterMetrics, reason: str, delay: float) -> None:
    metrics.child(metrics.binds, reason).inc()
    bind = EAGER if reason == EAGER else JUST_IN_TIME
    metrics.child(metrics.bind_delay, bind).observe(delay)


async def _until_due(attempt: Attempt, prefill: BackendState) -> str:
    """Wait until D's leg is due; returns why it is (``predicted``, ``prefill_done``,
    ``unlearned``). Raises :class:`NoBackendAvailable` when P's leg ended without an answer
    (that failure is the attempt's; no D is bound for it)."""
    pace = prefill.pace.prefill
    changed = _Changed()
    pace.listen(changed.fire)
    try:
        while True:
            ticket = attempt.p_ticket
            now = time.monotonic()
            finish = None if ticket is None else pace.finish(ticket, now)
            if attempt.prefill_answered is False:  # P's error is the attempt's answer
                raise NoBackendAvailable("decode not bound: the prefill did not answer")
            if finish is None:
                return "unlearned" if attempt.prefill_answered is None else "prefill_done"
            decodes = attempt.runtime.model(attempt.request.model).decode.usable()
            wait = finish - lead(attempt.runtime.settings, decodes) - pace.margin() - now
            if wait <= 0:
                return "predicted"
            await changed.wait(wait)
    finally:
        pace.unlisten(changed.fire)


class _Changed:
    """A wake-up for :func:`_until_due`: fired when a prefill on its P ends."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()

    async def wait(self, seconds: float) -> None:
        """Until fired or ``seconds`` passed; re-armed for the next wait."""
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
        except TimeoutError:
            pass
        self._event.clear()
