"""One forwarded request on one instance: its admission slot, the instance's answer as it is,
and the instance's breaker fed once.

Who calls it: the pass-through routes (:mod:`router.http.passthrough`), which choose the instance
with its pool's policy (the pool's ``choose`` counts it in flight) and hand it over here.
:meth:`Exchange.open` takes an admission slot (:class:`router.dispatch.holds.Holds`, as a
dispatch's legs do), sends the request through the router's one upstream client and reads the
answer's status: a 4xx (and vLLM's 501, "the model does not support this API") is the client's
and goes back as it is, without touching the breaker; a 5xx, a transport error or a timeout is
the instance's fault (:func:`router.dispatch.legs.leg_failed`) and raises. The answer's body is
then read whole (:meth:`Exchange.body`) or relayed as it comes (:class:`ProxiedStream`, for an
event stream); a body read to its end is the instance's success
(:func:`router.dispatch.legs.leg_ok`). Every wait is bounded: the whole exchange by the
request's deadline (``timeouts.total``), each chunk of a stream also by
``timeouts.inter_token``. :meth:`Exchange.close` gives the count and the slot back and closes the
answer; it is idempotent and must run however the request ends. A drain that runs out of time
aborts the request through its :class:`DrainHandle` (registered with the runtime's lifecycle):
the wait in progress is cancelled and the client gets a 503 (or, mid-stream, a final SSE error
event); :func:`watched` turns either cancellation (drain, or a client that left) into an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import httpx
from starlette.types import Receive, Scope, Send

from router.dispatch.holds import Holds
from router.dispatch.legs import leg_failed, leg_ok
from router.dispatch.relay import sse_error_event
from router.errors import (
    ClientDisconnected,
    RouterError,
    RouterNotReady,
    UpstreamError,
    UpstreamTimeout,
    outcome_label,
)
from router.http.disconnect import ClientWatch
from router.instances.state import BackendState
from router.runtime import Runtime
from router.upstream.calls import close_quietly, http_error, raw_chunks, read_raw, send_raw

T = TypeVar("T")

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
        self.response: httpx.Response | None = None
        self._closed = False

    @property
    def answer(self) -> httpx.Response:
        """The instance's answer (after :meth:`open`)."""
        assert self.response is not None, "open() first"
        return self.response

    @property
    def streams(self) -> bool:
        """True when the answer is an event stream (relayed as it comes)."""
        kind: str = self.answer.headers.get("content-type", "")
        return kind.startswith("text/event-stream")

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
                    self.response = await send_raw(
                        self.runtime.client, b, b.role, path, body, self.request_id
                    )
                    status = self.response.status_code
                    if status >= 500 and not is_client_status(status):
                        await read_raw(self.response, b.role, b)
                        raise http_error(self.response, b.role, b)
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
        b = self.backend
        try:
            try:
                async with asyncio.timeout(self._left()):
                    data = await read_raw(self.answer, b.role, b)
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
            async with aclosing(raw_chunks(self.answer, b.role, b)) as source:
                while True:
                    try:
                        async with asyncio.timeout(min(silence, self._left())):
                            chunk = await anext(source, None)
                    except TimeoutError as exc:
                        raise UpstreamTimeout(
                            b.role, b.label, f"nothing sent for {silence:g}s or past the deadline"
                        ) from exc
                    if chunk is None:
                        break
                    yield chunk
        except UpstreamError as exc:
            await self.fail(exc)
            raise
        self._done()

    def _done(self) -> None:
        """The body arrived whole: a success of the instance unless the status was the
        client's."""
        if self.answer.status_code < 400:
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
            await close_quietly(self.response)


class ProxiedStream:
    """An ASGI app relaying an exchange's event stream as it comes, in the request's own task.

    Before it runs, the handler has armed ``watch``; a client that leaves cancels the relay.
    The status and ``Content-Type`` are the instance's; a failure after the first byte ends the
    body with one SSE error event (``data: {"error": ...}``). However it ends, the exchange is
    closed and ``on_close(outcome)`` called once; it must not raise.
    """

    def __init__(
        self,
        exchange: Exchange,
        watch: ClientWatch,
        handle: DrainHandle,
        on_close: Callable[[str], None],
    ) -> None:
        self.exchange = exchange
        self.watch = watch
        self.handle = handle
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = self.exchange.answer
        headers = [
            (b"content-type", answer.headers.get("content-type", "").encode("latin-1")),
            (b"x-request-id", self.exchange.request_id.encode()),
        ]
        outcome = "client_disconnected"
        try:
            await send(
                {"type": "http.response.start", "status": answer.status_code, "headers": headers}
            )
            outcome = await self._relay(send)
        except asyncio.CancelledError:
            if self.watch.left():
                pass
            elif self.handle.took_back():
                outcome = await self._end(send, RouterNotReady(self.handle.reason or "stopping"))
            else:
                raise
        finally:
            self.watch.stop()  # before anything below awaits (router.http.disconnect)
            await self.exchange.close()
            self.on_close(outcome)

    async def _relay(self, send: Send) -> str:
        """Write the stream; the outcome label of how it ended."""
        outcome = "ok" if answer_ok(self.exchange) else "upstream_rejected"
        try:
            async with aclosing(self.exchange.chunks()) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RouterError as exc:
            return await self._end(send, exc)
        self.watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return outcome

    async def _end(self, send: Send, exc: RouterError) -> str:
        """End the body with one SSE error event for ``exc``; its outcome label."""
        self.watch.stop()
        event = sse_error_event(exc)
        await send({"type": "http.response.body", "body": event, "more_body": False})
        return outcome_label(exc)


def answer_ok(exchange: Exchange) -> bool:
    """True when the instance's answer is a success (not a client error passed back)."""
    return exchange.answer.status_code < 400


class DrainHandle:
    """The task serving one forwarded request, as a drain sees it
    (:class:`router.lifecycle.Abortable`)."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "DrainHandle must be created inside a task"
        self._task = task
        self.reason: str | None = None
        self._pending = False

    def abort(self, reason: str) -> None:
        """The drain's time is over: cancel the request where it waits."""
        self.reason = reason
        self._pending = True
        self._task.cancel()

    def took_back(self) -> bool:
        """For a cancellation caught where the request waits: True if it was :meth:`abort`'s
        (the task is then no longer counted as being cancelled)."""
        if not self._pending:
            return False
        self._pending = False
        self._task.uncancel()
        return True


async def watched(watch: ClientWatch, handle: DrainHandle, work: Awaitable[T]) -> T:
    """Await ``work`` in this task; :class:`ClientDisconnected` if the client left meanwhile,
    :class:`RouterNotReady` if a drain aborted the request (``work`` was cancelled where it
    waited and has cleaned up)."""
    try:
        return await work
    except asyncio.CancelledError:
        if watch.left():
            raise ClientDisconnected("client disconnected") from None
        if handle.took_back():
            raise RouterNotReady(handle.reason or "the router is shutting down") from None
        raise
