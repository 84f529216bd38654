"""The streamed answer of one dispatch, as a plain ASGI app: D's events as they come, written
in the request's own task.

Who calls it: :mod:`disagg_router.router.http.generate` returns one for a streamed request whose
dispatch has passed its commit point; the server then calls it with the request's ASGI
``scope``/``receive``/ ``send``. Unlike Starlette's ``StreamingResponse`` it spawns no task group
per request (docs/benchmarks/README.md, "Router overhead"). Under the router's own server
protocol (:mod:`disagg_router.router.http.protocol`) the relay may also write D's events to the
connection itself, spliced (:meth:`disagg_router.router.dispatch.relay.Relay.sse_events`).
However the stream ends (done, failed, client gone, router stopping) the dispatch is closed and
``on_close`` is called once; it must not raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextlib import aclosing

from starlette.types import Receive, Scope, Send

from disagg_router.router.dispatch.attempt import Dispatch
from disagg_router.router.dispatch.migration import Migrating
from disagg_router.router.dispatch.state import Outlet
from disagg_router.router.http.disconnect import ClientWatch
from disagg_router.router.http.protocol import body_writer_of

Streamed = Dispatch | Migrating


class DispatchStream:
    """An ASGI app that writes one dispatch's SSE stream (see the module docstring).

    ``watch`` (armed by the handler) cancels the relay if the client leaves.
    """

    def __init__(
        self,
        dispatch: Streamed,
        watch: ClientWatch,
        on_close: Callable[[Streamed], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``headers``: more response headers (the tenant's rate-limit headers)."""
        self.dispatch = dispatch
        self.outlet: Outlet | None = None  # the server's writer for this answer, if it has one
        self.watch = watch
        self.on_close = on_close
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"x-request-id", dispatch.request_id.encode()),
            *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.outlet = body_writer_of(scope)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            if not await self._relay(send):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.watch.left():
                raise
        finally:
            self.watch.stop()  # before anything below awaits (disagg_router.router.http.disconnect)
            if self.dispatch.outcome == "in_progress":
                self.dispatch.outcome = "client_disconnected"
            await self.dispatch.close()
            self.on_close(self.dispatch)

    async def _relay(self, send: Send) -> bool:
        """Write the dispatch's events; True when the last write also ended the body."""
        last = False
        async with aclosing(self.dispatch.sse_events(self.outlet)) as events:
            async for chunk in events:
                # The chunk that ends the stream (outcome set) also ends the body: one write.
                last = self.dispatch.outcome != "in_progress"
                if last:
                    self.watch.stop()  # the answer is complete: a disconnect changes nothing
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        return last
