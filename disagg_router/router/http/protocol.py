"""The router's HTTP/1.1 connection protocol: uvicorn's httptools protocol with time and count
bounds on client connections, and OpenAI-style errors for what never reaches the app.

Who calls it: :func:`disagg_router.router.server.uvicorn_config` hands the class made by
:func:`protocol_class` to uvicorn (``http=``), for ``serve`` and for every worker of
``serve --workers N``. Each method overrides a public callback of
``uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`` and calls it; besides its
callbacks, only its public ``scope``, ``cycle``, ``transport``, ``loop`` and ``connections`` are
used, never its private state. What a client sees when a bound fires:

- ``limits.max_connections``: a connection opened while that many are open gets a 503 JSON
  error with ``Retry-After: 1`` and is closed at once (its descriptor is freed immediately);
- ``limits.idle_connection_timeout``: a connection that sends nothing (empty lines do not count)
  is closed without an answer;
- ``limits.keep_alive``: a connection that has had its answer and begins no new request in that
  time is closed without an answer (what trails the answered request, the rest of its body or
  empty lines, does not count);
- ``limits.header_timeout``: a request whose line and headers are not complete this many seconds
  after its first byte gets a 408 JSON error and the connection is closed;
- ``limits.max_header_bytes``: headers still incomplete past that size get a 431 JSON error
  (complete ones are checked by the app, :mod:`disagg_router.router.http.bounds`) and the connection
  is closed;
- a request the HTTP parser rejects (``Content-Length: -1``, a broken request line) gets a 400
  JSON error instead of uvicorn's plain text.

Each of these answers carries a fresh ``X-Request-Id`` and ``Connection: close``. The app's own
answers after which the request stream cannot be trusted (413, 408 on a slow body, 431 on complete
headers) say ``Connection: close`` too (:func:`disagg_router.router.http.generate.error_response`),
and uvicorn closes the connection once they are sent.

Each connection also has one :class:`~disagg_router.router.http.disconnect.DisconnectNotice`, put
into the scope of every request it carries (``extensions``) and told from ``connection_lost``, so a
request's :class:`~disagg_router.router.http.disconnect.ClientWatch` hears of a leaving client
without a task of its own. And each request's scope carries a :class:`BodyWriter` for its answer
(:func:`body_writer_of`), with which a streamed answer's chunks can be written from any callback,
not only through the ASGI ``send``: it reads the request's ``cycle`` (``response_started``,
``response_complete``, ``chunked_encoding``, ``disconnected``, ``flow.write_paused``,
``transport``), public attributes of uvicorn's ``RequestResponseCycle`` at the pinned version.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from disagg_router.router.config import LimitsConfig
from disagg_router.router.errors import (
    ClientRequestError,
    RouterError,
    RouterNotReady,
    error_payload,
)
from disagg_router.router.http.disconnect import NOTICE, DisconnectNotice
from disagg_router.router.ids import new_request_id

_INVALID = "invalid_request_error"
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


BODY_WRITER = "disagg_router.body_writer"
"""The key of a request's :class:`BodyWriter` in its scope's ``extensions``."""


class BodyWriter:
    """Writes chunks of one request's answer body straight to its connection, framed as
    uvicorn's ``send`` frames them (chunked transfer encoding), so the two can take turns.

    Who calls it: the relay of a streamed answer
    (:class:`disagg_router.router.dispatch.state.Outlet`), from the event loop's callbacks,
    between the ASGI ``send`` that starts the answer and the one that ends it; ``write`` only
    after ``ready()`` said so, and never while a ``send`` of the same answer waits."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        """The answer has begun, chunked and not ended; the client is there and keeping up
        (uvicorn's flow control has not paused writing)."""
        cycle = self._cycle
        return (
            cycle.response_started
            and not cycle.response_complete
            and cycle.chunked_encoding is True
            and not cycle.disconnected
            and not cycle.flow.write_paused
            and not cycle.transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        """One chunk of the body (``data`` non-empty; an empty one writes nothing)."""
        if data:
            self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


def body_writer_of(scope: Scope) -> BodyWriter | None:
    """The request's :class:`BodyWriter` (None under another server)."""
    extensions = scope.get("extensions")
    writer = extensions.get(BODY_WRITER) if extensions else None
    return writer if isinstance(writer, BodyWriter) else None


def error_answer(exc: RouterError) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection: ``exc``'s status and OpenAI-style
    error body (:func:`disagg_router.router.errors.error_payload`), ``Retry-After`` when it has one,
    and a fresh ``X-Request-Id``."""
    body = json.dumps(error_payload(exc)).encode()
    lines = [
        b"HTTP/1.1 %d %s" % (exc.status, _REASONS.get(exc.status, b"")),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"x-request-id: " + new_request_id().encode(),
        b"connection: close",
    ]
    if exc.retry_after is not None:
        lines.append(b"retry-after: %d" % exc.retry_after)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """One client connection (see the module doc); ``limits`` is set by :func:`protocol_class`.

    Timers: ``_bound_idle`` runs while the connection waits for a request: from its opening
    (``idle_connection_timeout``) or from an answer's end (``keep_alive``) to the next request's
    first byte (``on_message_begin``);
    ``_bound_header`` from a request's first byte to the end of its headers, armed only when a
    read ends with the headers incomplete (a request whose headers come in one read, the usual
    case, makes no timer). Both are cancelled on ``connection_lost``. Our attributes are
    prefixed ``_bound_`` so they cannot collide with the base class's. Callbacks run on the
    event loop and must not block."""

    limits: LimitsConfig = LimitsConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bound_idle: asyncio.TimerHandle | None = None
        self._bound_header: asyncio.TimerHandle | None = None
        self._bound_header_bytes = 0
        self._bound_header_pending = False  # a request's headers begun, not yet complete
        self._bound_header_began = 0.0
        self._bound_notice = DisconnectNotice()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            message = f"the router has {self.limits.max_connections} client connections open"
            self._answer(error_answer(RouterNotReady(message, retry_after=1)))
            return
        idle = self.limits.idle_connection_timeout
        self._bound_idle = self.loop.call_later(idle, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        self._bound_notice.connection_lost()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._bound_header_pending:  # headers still incomplete after this chunk
            self._bound_header_bytes += len(data)
            if self._bound_header_bytes > self.limits.max_header_bytes:
                message = f"request headers exceed {self.limits.max_header_bytes} bytes"
                self._answer(error_answer(RouterError(message, status=431, error_type=_INVALID)))
            elif self._bound_header is None:  # armed only now: most headers come in one read
                due = self._bound_header_began + self.limits.header_timeout
                self._bound_header = self.loop.call_at(due, self._header_expired)

    def on_message_begin(self) -> None:
        if self._bound_idle is not None:  # a request begins: the connection is no longer idle
            self._bound_idle.cancel()
            self._bound_idle = None
        super().on_message_begin()  # the request's scope is made here, its app not yet started
        scope = cast(dict[str, Any], self.scope)  # uvicorn types extensions' values as dicts
        scope.setdefault("extensions", {})[NOTICE] = self._bound_notice
        if not self._bound_header_pending:
            self._bound_header_pending = True
            self._bound_header_bytes = 0
            self._bound_header_began = self.loop.time()

    def on_headers_complete(self) -> None:
        self._bound_header_pending = False
        if self._bound_header is not None:
            self._bound_header.cancel()
            self._bound_header = None
        super().on_headers_complete()  # the request's cycle is made here, its app not started
        cycle = self.cycle
        if cycle is not None:
            extensions = cast(dict[str, Any], cycle.scope).setdefault("extensions", {})
            extensions[BODY_WRITER] = BodyWriter(cycle)

    def on_response_complete(self) -> None:
        """An answer is sent: unless the connection is closing or another request is already
        under way (pipelined), it has ``limits.keep_alive`` seconds to begin its next request.
        uvicorn's own keep-alive timer is not enough: any byte received after the answer (the
        rest of the answered request's body, an empty line) cancels it for good."""
        super().on_response_complete()
        busy = self.cycle is not None and not self.cycle.response_complete
        if self.transport.is_closing() or busy or self._bound_header_pending:
            return
        if self._bound_idle is not None:
            self._bound_idle.cancel()
        self._bound_idle = self.loop.call_later(self.limits.keep_alive, self._idle_expired)

    def send_400_response(self, msg: str) -> None:
        """The parser rejected the request: a 400 in OpenAI error form (not uvicorn's text)."""
        detail = f"malformed HTTP request: {msg.rstrip('.')}"
        self._answer(error_answer(ClientRequestError(detail, None)))

    def _idle_expired(self) -> None:
        self._bound_idle = None
        if not self.transport.is_closing():
            self.transport.close()

    def _header_expired(self) -> None:
        self._bound_header = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request behind an answer still being sent: let that answer finish.
            self._arm_header()
            return
        message = f"request headers not received within {self.limits.header_timeout:g}s"
        self._answer(error_answer(RouterError(message, status=408, error_type=_INVALID)))

    def _arm_header(self) -> None:
        self._bound_header = self.loop.call_later(self.limits.header_timeout, self._header_expired)

    def _answer(self, raw: bytes) -> None:
        self._cancel_timers()
        if not self.transport.is_closing():
            self.transport.write(raw)
            self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._bound_idle, self._bound_header):
            if timer is not None:
                timer.cancel()
        self._bound_idle = self._bound_header = None
        self._bound_header_pending = False


def protocol_class(limits: LimitsConfig) -> type[BoundedHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``."""
    return type("RouterHttpProtocol", (BoundedHttpProtocol,), {"limits": limits})
