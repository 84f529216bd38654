"""The client's side of a forwarded (pass-through) request: the answer relayed as it comes, and
how a drain or a client that leaves ends the wait in progress.

Who calls it: the pass-through routes (:mod:`disagg_router.router.http.passthrough`), with an
exchange they opened. :class:`ProxiedStream` relays an event stream in the request's own task. A
drain that runs out of time aborts the request through its :class:`DrainHandle` (registered with the
runtime's lifecycle): the wait in progress is cancelled and the client gets a 503 (or, mid-stream, a
final SSE error event); :func:`disagg_router.router.http.disconnect.watched` turns either
cancellation (drain, or a client that left) into an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import aclosing

from starlette.types import Receive, Scope, Send

from disagg_router.router.dispatch.forward import Exchange, answer_ok
from disagg_router.router.dispatch.relay import sse_error_event
from disagg_router.router.errors import (
    RouterError,
    RouterNotReady,
    outcome_label,
)
from disagg_router.router.http.disconnect import ClientWatch


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
            (b"content-type", answer.content_type.encode("latin-1")),
            (b"x-request-id", self.exchange.request_id.encode()),
        ]
        outcome = "client_disconnected"
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": headers})
            outcome = await self._relay(send)
        except asyncio.CancelledError:
            if self.watch.left():
                pass
            elif self.handle.took_back():
                outcome = await self._end(send, RouterNotReady(self.handle.reason or "stopping"))
            else:
                raise
        finally:
            self.watch.stop()  # before anything below awaits (disagg_router.router.http.disconnect)
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


class DrainHandle:
    """The task serving one forwarded request, as a drain sees it
    (:class:`disagg_router.router.lifecycle.Abortable`)."""

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
