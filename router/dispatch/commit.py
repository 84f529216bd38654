"""The commit point of one attempt: both legs started, then D's first token (or, not streamed,
D's whole answer) awaited within its deadline.

Who calls it: :meth:`router.dispatch.attempt.Dispatch.open`, after admission. Until the first
token nothing has gone to the client, so any failure here may still be retried on a fresh pair
(:mod:`router.dispatch.orchestrator`). It raises P's error if P fails first, D's if D fails
before its first token, and :class:`UpstreamTimeout` (fed to the breaker of the leg that kept
it waiting) when the first token does not come within ``timeouts.first_token`` (streams) or
before the request's ``timeouts.total`` deadline. It cancels nothing: the caller closes the
attempt in every case.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from router.dispatch.holds import Holds
from router.dispatch.legs import decode_leg, leg_failed, prefill_leg
from router.dispatch.state import Attempt, DecodeItem
from router.errors import RouterError, UpstreamTimeout

log = logging.getLogger(__name__)


async def until_first_token(attempt: Attempt, holds: Holds) -> None:
    """Start both legs (P, if any, and D) and return once D's first payload is in
    ``attempt.first``; raises as the module docstring says."""
    if attempt.prefill is not None:
        attempt.p_task = asyncio.create_task(prefill_leg(attempt, holds, attempt.prefill))
    attempt.d_task = asyncio.create_task(decode_leg(attempt, holds))
    deadline, limit = _deadline(attempt)
    get = asyncio.create_task(attempt.queue.get())
    waiting: set[asyncio.Future[Any]] = {get}
    p_task = attempt.p_task
    if p_task is not None:
        waiting.add(p_task)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(attempt, limit)
            done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if p_task is not None and p_task in done:
                waiting.discard(p_task)
                p_exc = p_task.exception()
                if p_exc is not None:
                    raise p_exc
            if get in done:
                _take_first(attempt, get.result())
                return
    finally:
        get.cancel()


def _deadline(attempt: Attempt) -> tuple[float, float]:
    """When the first token must have come, and the configured limit that sets it."""
    t = attempt.runtime.settings.timeouts
    first_token_by = attempt.started + t.first_token if attempt.request.stream else attempt.deadline
    deadline = min(first_token_by, attempt.deadline)
    return deadline, t.first_token if deadline < attempt.deadline else t.total


def _timed_out(attempt: Attempt, limit: float) -> UpstreamTimeout:
    """The timeout of the leg the attempt still waits for (P while P runs, else D), fed to
    that instance's breaker."""
    prefill = attempt.prefill
    p_busy = attempt.p_task is not None and not attempt.p_task.done()
    backend = prefill if p_busy and prefill is not None else attempt.decode
    leg = "prefill" if backend is prefill else "decode"
    exc = UpstreamTimeout(leg, backend.label, f"no first token within {limit:g}s")
    leg_failed(attempt.runtime, backend, exc)
    return exc


def _take_first(attempt: Attempt, item: DecodeItem) -> None:
    """Keep D's first payload; raise the error D queued instead of one."""
    if isinstance(item, RouterError):
        raise item
    attempt.first = item
    attempt.mark("first_token")
    log.debug(
        "dispatch %s: first token after %.3fs",
        attempt.request_id,
        time.monotonic() - attempt.started,
    )
