"""One forwarded (pass-through) request on one instance: the instance chosen by its pool's
policy, the instance's answer as it is, its admission slot, and its breaker fed once.

Who calls it: the pass-through routes (:mod:`disagg_router.router.http.passthrough`), which open an
exchange with :func:`open_exchange` and relay its answer. The one retry loop
(:mod:`disagg_router.router.dispatch.retry`) picks the instance. :meth:`Exchange.open` takes an
admission slot (:class:`disagg_router.router.dispatch.holds.Holds`, as a dispatch's legs do), sends
the request through the router's one upstream client and reads the answer's status: a 4xx (and
vLLM's 501, "the model does not support this API") is the client's and goes back as it is, without
touching the breaker; a 5xx, a transport error or a timeout is the instance's fault
(:func:`disagg_router.router.dispatch.legs.leg_failed`) and raises. The answer's body is then read
whole (:meth:`Exchange.body`) or as it comes (:meth:`Exchange.chunks`, for an event stream); a body
read to its end is the instance's success (:func:`disagg_router.router.dispatch.legs.leg_ok`). Every
wait is bounded: the whole exchange by the request's deadline (``timeouts.total``), each chunk of a
stream also by ``timeouts.inter_token``. :meth:`Exchange.close` gives the count and the slot back
and closes the answer; it is idempotent and must run however the request ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from disagg_router.router.dispatch.holds import Holds
from disagg_router.router.dispatch.legs import leg_failed, leg_ok
from disagg_router.router.dispatch.retry import first_that_opens
from disagg_router.router.errors import UpstreamError, UpstreamTimeout
from disagg_router.router.instances.state import BackendState, Role
from disagg_router.router.routing.policies.base import RoutingInput
from disagg_router.router.runtime import Runtime
from disagg_router.router.upstream.calls import RawAnswer, open_raw


@dataclass(frozen=True)
class Forward:
    """One validated pass-through request: where it goes and what it carries."""

    path: str
    model: str
    body: dict[str, Any]
    role: Role
    headers: dict[str, str] = field(default_factory=dict)


CLIENT_STATUSES = frozenset({501})
"""Statuses beyond 4xx that are the request's fault, not the instance's: vLLM answers 501 to a
route its model does not serve (e.g. ``/v1/responses`` without a chat template)."""


def is_client_status(status: int) -> bool:
    """True for an answer passed back as it is without counting against the instance."""
    return 400 <= status < 500 or status in CLIENT_STATUSES


class Exchange:
    """One request forwarded to ``backend`` (already counted in flight by its pool)."""

    def __init__(
        self, runtime: Runtime, backend: BackendState, request_id: str, deadline: float
    ) -> None:
        self.runtime = runtime
        self.backend = backend
        self.request_id = request_id
        self.deadline = deadline
        self.holds = Holds(runtime.metrics, [backend])
        self.response: RawAnswer | None = None
        self._closed = False

    @property
    def prefill(self) -> BackendState | None:
        """The instance, when it is of the model's P pool (the request log's ``prefill``)."""
        return self.backend if self.backend.role == "prefill" else None

    @property
    def decode(self) -> BackendState | None:
        """The instance, when it is of the model's D pool (the request log's ``decode``)."""
        return self.backend if self.backend.role == "decode" else None

    @property
    def timings(self) -> dict[str, float]:
        """No stages are timed for a forwarded request (the request log's ``timings``)."""
        return {}

    @property
    def answer(self) -> RawAnswer:
        """The instance's answer (after :meth:`open`)."""
        assert self.response is not None, "open() first"
        return self.response

    @property
    def streams(self) -> bool:
        """True when the answer is an event stream (relayed as it comes)."""
        return self.answer.content_type.startswith("text/event-stream")

    def _left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def _timeout(self, what: str) -> UpstreamTimeout:
        total = self.runtime.settings.timeouts.total
        return UpstreamTimeout(self.backend.role, self.backend.label, f"{what} within {total:g}s")

    async def open(self, path: str, body: dict[str, object]) -> None:
        """Slot, request, status (see the module docstring); raises the failure after closing."""
        b = self.backend
        try:
            await self.holds.admit()  # bounded by admission.max_wait; a full queue is no fault
            try:
                async with asyncio.timeout(self._left()):
                    answer = await open_raw(
                        self.runtime.client, b, b.role, path, body, self.request_id
                    )
                    self.response = answer
                    if answer.status >= 500 and not is_client_status(answer.status):
                        raise answer.error(await answer.read())
            except TimeoutError as exc:
                raise self._timeout("no answer") from exc
        except UpstreamError as exc:
            await self.fail(exc)
            raise
        except BaseException:
            await self.close()
            raise

    async def body(self) -> bytes:
        """The whole body of the answer; an :class:`UpstreamError` (after :meth:`fail`) if it
        breaks or the deadline passes."""
        try:
            try:
                async with asyncio.timeout(self._left()):
                    data = await self.answer.read()
            except TimeoutError as exc:
                raise self._timeout("answer not complete") from exc
        except UpstreamError as exc:
            await self.fail(exc)
            raise
        self._done()
        return data

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The answer's body as it arrives; an :class:`UpstreamError` (after :meth:`fail`) when
        it breaks, when the instance is silent for ``timeouts.inter_token`` or the deadline
        passes."""
        b = self.backend
        silence = self.runtime.settings.timeouts.inter_token
        try:
            while True:
                try:
                    async with asyncio.timeout(min(silence, self._left())):
                        chunk = await self.answer.read_chunk()
                except TimeoutError as exc:
                    raise UpstreamTimeout(
                        b.role, b.label, f"nothing sent for {silence:g}s or past the deadline"
                    ) from exc
                if not chunk:
                    break
                yield chunk
        except UpstreamError as exc:
            await self.fail(exc)
            raise
        self._done()

    def _done(self) -> None:
        """The body arrived whole: a success of the instance unless the status was the
        client's."""
        if self.answer.status < 400:
            leg_ok(self.runtime, self.backend)

    async def fail(self, exc: UpstreamError) -> None:
        """Feed ``exc`` to the instance's breaker and close."""
        leg_failed(self.runtime, self.backend, exc)
        await self.close()

    async def close(self) -> None:
        """Close the answer, give the count and the slot back (idempotent)."""
        self.holds.release_all()  # first: nothing below may keep the slot if it is cancelled
        if self.response is not None and not self._closed:
            self._closed = True
            await self.response.close()


def answer_ok(exchange: Exchange) -> bool:
    """True when the instance's answer is a success (not a client error passed back)."""
    return exchange.answer.status < 400


async def open_exchange(runtime: Runtime, call: Forward, request_id: str) -> Exchange:
    """An exchange whose answer's status and headers are in hand; the caller must close it.

    The instance comes from the model's ``call.role`` pool; a retryable failure is retried once
    (:func:`disagg_router.router.dispatch.retry.first_that_opens`) on another instance with a fresh
    id; raises the last failure."""
    found = runtime.model(call.model)
    pool = found.prefill if call.role == "prefill" else found.decode
    routed = RoutingInput(call.body, "messages" in call.body, call.headers)
    deadline = time.monotonic() + runtime.settings.timeouts.total

    def choose(avoid: set[str], failed: UpstreamError | None) -> BackendState:
        return pool.choose(avoid, routed, strict=failed is not None)

    async def open_attempt(backend: BackendState, rid: str) -> Exchange:
        exchange = Exchange(runtime, backend, rid, deadline)
        await exchange.open(call.path, call.body)
        return exchange

    return await first_that_opens(runtime, call.path, request_id, choose, open_attempt)
