"""One P/D dispatch attempt, shared by push and pull mode: its lifecycle, from the pair to close.

Who calls it: :func:`disagg_router.router.dispatch.orchestrator.open_dispatch`, which chooses the
pair (each leg already counted in flight by its pool) and may retry on a fresh one; the HTTP layer
then relays and closes it. Lifecycle: ``open()`` admits the pair and runs the legs up to the commit
point (D's first token, or D's whole answer for a non-streamed request); then ``sse_events()`` or
``json_response()`` relays the rest; then ``close()`` (always, also on errors and disconnects)
cancels whatever still runs and gives back what the attempt holds.

The pieces: :mod:`disagg_router.router.dispatch.state` (what they share),
:mod:`disagg_router.router.dispatch.holds` (in-flight counts and admission),
:mod:`disagg_router.router.dispatch.legs` (P's and D's leg),
:mod:`disagg_router.router.dispatch.commit` (up to the first token),
:mod:`disagg_router.router.dispatch.relay` (after it). The only difference between the modes is when
the D leg may start: in push mode right away with P's identity (so D's block registration overlaps
prefill); in pull mode after P answered, with the ``kv_transfer_params`` P returned. Every wait is
bounded by a configured timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from disagg_router.router.dispatch.commit import until_first_token
from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.relay import Relay, SseEvents
from disagg_router.router.dispatch.state import Attempt, Outlet
from disagg_router.router.errors import (
    NoBackendAvailable,
    RouterError,
    RouterNotReady,
    UpstreamError,
)
from disagg_router.router.instances.state import BackendState
from disagg_router.router.observability.tracing import NO_SPAN

log = logging.getLogger(__name__)


class Dispatch:
    """Both legs of one attempt (:class:`~disagg_router.router.dispatch.state.Attempt`: one (P, D)
    pair, one fresh request id, the request's deadline).

    P None: D alone (conditional disaggregation): D gets the client's request as is (without
    ``kv_transfer_params``) and prefills locally; there is no P leg and no transfer. P and D come
    counted in flight by their pools' ``choose()``; the dispatch owns those counts from here on.
    A D bound late (``attempt.choose_decode``, :mod:`disagg_router.router.dispatch.binding`)
    comes uncounted: it is chosen, counted and admitted by its leg.
    """

    def __init__(self, attempt: Attempt) -> None:
        self._a = attempt
        late = attempt.choose_decode is not None  # D is counted and admitted when bound
        legs = [b for b in (attempt.prefill, None if late else attempt.decode) if b is not None]
        demand = None if attempt.kv_demand is None else (attempt.kv_demand, attempt.prompt_tokens)
        self._holds = Holds(attempt.runtime.metrics, legs, attempt.ctx.claim, demand)
        self._relay = Relay(attempt)

    @property
    def request_id(self) -> str:
        return self._a.request_id

    @property
    def prefill(self) -> BackendState | None:
        return self._a.prefill

    @property
    def decode(self) -> BackendState:
        return self._a.decode

    @property
    def binds_late(self) -> bool:
        """D is not chosen yet: it will be when its leg is due (push.bind)."""
        return self._a.choose_decode is not None

    @property
    def timings(self) -> dict[str, float]:
        """Stage -> seconds since the attempt started (the request log's ``timings``)."""
        return self._a.timings

    @property
    def usage(self) -> Any:
        """The usage object the client got (P's prompt tokens, D's completion tokens); None
        until the relay sent it, and for a stream that did not ask for it."""
        return self._a.usage

    @property
    def answered(self) -> float:
        """``time.monotonic()`` when the answer's last chunk was ready for the client; 0.0 until
        the answer is complete."""
        return self._a.answered

    @property
    def outcome(self) -> str:
        """``in_progress`` until the answer ended: ``ok``, ``decode_failed_midstream``, or what
        the HTTP layer sets (``client_disconnected``)."""
        return self._a.outcome

    @outcome.setter
    def outcome(self, value: str) -> None:
        self._a.outcome = value

    async def open(self) -> None:
        """Admit the pair, start both legs and wait for D's first token (the commit point).

        Raises :class:`~disagg_router.router.errors.Overloaded` when an instance is full, the
        failing leg's error if P fails first or D fails before its first token, and
        :class:`~disagg_router.router.errors.UpstreamTimeout` if the first token does not come in
        time. The caller must call ``close()`` in every case.
        """
        a = self._a
        settings = a.runtime.settings
        if settings.mode == "push" and a.prefill is not None:
            a.sent_identity = a.prefill.identity
            if a.sent_identity is None:
                raise NoBackendAvailable(f"prefill {a.prefill.label} has no known identity")
        if log.isEnabledFor(logging.DEBUG):
            self._log_open()
        a.runtime.lifecycle.enter(self)
        await self._holds.admit()
        a.mark("admitted")
        first_token = a.ctx.trace
        if first_token is not NO_SPAN:  # tracing off: no attributes to build for the no-op span
            first_token = first_token.child("first_token", {"request_id": a.request_id})
        try:
            await until_first_token(a, self._holds)
        except RouterError as exc:
            first_token.end(exc.message)
            raise
        first_token.end()

    def _log_open(self) -> None:
        a = self._a
        log.debug(
            "dispatch %s: %s %s prefill=%s (engine %s) decode=%s",
            a.request_id,
            a.runtime.settings.mode,
            a.request.path,
            a.prefill.label if a.prefill is not None else "-",
            a.sent_identity.engine_id if a.sent_identity else "-",
            a.decode.label,
        )

    def abort(self, reason: str) -> None:
        """End this dispatch early (router stopping): its client gets an error now, before or
        after the commit point; the legs are cancelled by ``close()`` as always."""
        self._a.queue.put_nowait(RouterNotReady(reason))

    def hand_over(self, may_continue: Callable[[UpstreamError], bool]) -> None:
        """After ``open()``: ``may_continue`` decides, when D fails mid-stream, whether the
        caller takes the stream on elsewhere (:class:`~.relay.StreamBroken` then ends
        ``sse_events()``) or the stream ends with its error event."""
        self._a.hand_over = may_continue

    def sse_events(self, outlet: Outlet | None = None) -> SseEvents:
        """The client's SSE bytes after ``open()`` (:meth:`Relay.sse_events`)."""
        return self._relay.sse_events(outlet)

    async def json_response(self) -> dict[str, Any]:
        """The non-streamed answer for the client after ``open()``, usage merged."""
        return await self._relay.json_response()

    async def let_prefill_finish(self) -> None:
        """Wait for P's leg to end (at most what is left of ``timeouts.prefill`` and of the
        request's deadline) rather than have ``close()`` cancel it. Called after an answer (P's
        answer can come after D's last token in push mode) and before a retry that keeps P: P
        then has the whole prompt in its prefix cache, where a prefill cancelled half-way would
        leave the retry to compute the rest again."""
        a = self._a
        p_task = a.p_task
        if p_task is None or p_task.done():
            return
        left = min(a.started + a.runtime.settings.timeouts.prefill, a.deadline) - time.monotonic()
        if left > 0:
            await asyncio.wait({p_task}, timeout=left)

    async def close(self) -> None:
        """Cancel whatever leg still runs, wait for it to unwind, give back the in-flight counts
        and admission slots (idempotent).

        After a successful answer the P leg is drained first (its answer can arrive after D's
        last token in push mode), bounded by what is left of the prefill timeout; reading it to
        the end also keeps the connection to P reusable.
        """
        a = self._a
        if a.outcome == "ok":
            await self.let_prefill_finish()
        tasks = [t for t in (a.d_task, a.p_task) if t is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        if all(task.done() for task in tasks):  # the usual case: no gathering future to wait on
            results = [_outcome(task) for task in tasks]
        else:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        self._holds.release_all()
        a.runtime.lifecycle.leave(self)
        p_result = results[-1] if a.p_task is not None else None
        if isinstance(p_result, UpstreamError) and a.outcome == "ok":
            log.warning("dispatch %s: prefill failed after commit: %s", a.request_id, p_result)


def _outcome(task: asyncio.Task[Any]) -> object:
    """What ``asyncio.gather(..., return_exceptions=True)`` gives for the finished ``task``."""
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()
