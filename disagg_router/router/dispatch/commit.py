"""The commit point of one attempt: both legs started, then D's first token (or, not streamed,
D's whole answer) awaited within its deadline.

Who calls it: :meth:`disagg_router.router.dispatch.attempt.Dispatch.open`, after admission. Until
the first token nothing has gone to the client, so any failure here may still be retried on a fresh
pair (:mod:`disagg_router.router.dispatch.orchestrator`). It raises P's error if P fails first, D's
if D fails before its first token, and :class:`UpstreamTimeout` (fed to the breaker of the leg that
kept it waiting) when the first token does not come within ``timeouts.first_token`` (streams),
within ``timeouts.after_prefill`` of P's answer (streams: a D that hangs on the hand-off is found
that long after P finished, however long P's queue was) or before the request's ``timeouts.total``
deadline. It cancels nothing: the caller closes the attempt in every case.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.legs import decode_leg, leg_failed, prefill_leg
from disagg_router.router.dispatch.state import Attempt, DecodeItem
from disagg_router.router.errors import RouterError, UpstreamTimeout

log = logging.getLogger(__name__)


async def until_first_token(attempt: Attempt, holds: Holds) -> None:
    """Start both legs (P, if any, and D) and return once D's first payload is in
    ``attempt.first``; raises as the module docstring says.

    The first payload is awaited in this task, with no task or ``asyncio.wait`` of its own per
    request: a P that fails meanwhile cancels the wait (:class:`_PrefillWatch`)."""
    if attempt.prefill is not None:
        attempt.p_task = asyncio.create_task(prefill_leg(attempt, holds, attempt.prefill))
    attempt.d_task = asyncio.create_task(decode_leg(attempt, holds))
    deadline, limit = _deadline(attempt)
    left = deadline - time.monotonic()
    if left <= 0:
        raise _timed_out(attempt, f"no first token within {limit:g}s")
    handoff = attempt.runtime.settings.timeouts.after_prefill if attempt.request.stream else None
    timer = asyncio.timeout(left)
    watch = _PrefillWatch(attempt.p_task, timer, handoff)
    try:
        async with timer:
            item = await attempt.queue.get()
    except TimeoutError:
        raise _timed_out(attempt, watch.reason or f"no first token within {limit:g}s") from None
    except asyncio.CancelledError:
        p_exc = watch.failure()
        if p_exc is None:
            raise
        raise p_exc from None
    finally:
        watch.stop()
    _take_first(attempt, item)


class _PrefillWatch:
    """While the commit point waits for D, cancels that wait if P fails first (P's error is
    then the answer, as when both end together) and, once P answered, brings the wait's
    ``timer`` forward to ``handoff`` seconds from then (None: no such bound). Made and stopped in
    the waiting task, before it enters ``timer`` (P's callbacks run only once it awaits)."""

    def __init__(
        self, p_task: asyncio.Task[Any] | None, timer: asyncio.Timeout, handoff: float | None
    ) -> None:
        self._p_task = p_task
        self._timer = timer
        self._handoff = handoff
        self._waiter = asyncio.current_task()
        self._fired = False
        self.reason: str | None = None  # set when the hand-off bound is the timer's deadline
        if p_task is not None:
            p_task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        if self._waiter is None or task.cancelled():
            return
        if task.exception() is not None:
            self._fired = True
            self._waiter.cancel()
        elif self._handoff is not None:
            self._tighten(self._handoff)

    def _tighten(self, handoff: float) -> None:
        if self._timer.expired():  # the wait is already ending: nothing left to bring forward
            return
        by = asyncio.get_running_loop().time() + handoff
        when = self._timer.when()
        if when is None or by < when:
            self._timer.reschedule(by)
            self.reason = f"no first token within {handoff:g}s of P's answer"

    def stop(self) -> None:
        """Stop watching (idempotent): P's later failure is the relay's concern."""
        if self._p_task is not None:
            self._p_task.remove_done_callback(self._on_done)
        self._waiter = None

    def failure(self) -> BaseException | None:
        """For a cancellation caught while waiting: P's error if this watch cancelled the wait
        and no one else also cancelled the task (their cancellation then goes on), else None."""
        if not self._fired or self._waiter is None or self._p_task is None:
            return None
        if self._waiter.uncancel() > 0:
            return None
        return self._p_task.exception()


def _deadline(attempt: Attempt) -> tuple[float, float]:
    """When the first token must have come, and the configured limit that sets it."""
    t = attempt.runtime.settings.timeouts
    first_token_by = attempt.started + t.first_token if attempt.request.stream else attempt.deadline
    deadline = min(first_token_by, attempt.deadline)
    return deadline, t.first_token if deadline < attempt.deadline else t.total


def _timed_out(attempt: Attempt, reason: str) -> UpstreamTimeout:
    """The timeout of the leg the attempt still waits for (P while P runs, else D), fed to
    that instance's breaker."""
    prefill = attempt.prefill
    p_busy = attempt.p_task is not None and not attempt.p_task.done()
    unbound = attempt.choose_decode is not None  # D bound late, not yet: P kept it waiting
    backend = prefill if (p_busy or unbound) and prefill is not None else attempt.decode
    leg = "prefill" if backend is prefill else "decode"
    exc = UpstreamTimeout(leg, backend.label, reason)
    leg_failed(attempt.runtime, backend, exc)
    return exc


def _take_first(attempt: Attempt, item: DecodeItem) -> None:
    """Keep D's first payload; raise the error D queued instead of one."""
    if isinstance(item, RouterError):
        raise item
    attempt.first = item
    attempt.mark("first_token")
    if log.isEnabledFor(logging.DEBUG):
        took = time.monotonic() - attempt.started
        log.debug("dispatch %s: first token after %.3fs", attempt.request_id, took)
