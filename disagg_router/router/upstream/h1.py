"""The router's upstream HTTP/1.1 connections: keep-alive sockets on asyncio protocols, answers
parsed by httptools.

Who uses it: :class:`disagg_router.router.upstream.client.UpstreamClient`, the router's one upstream
client, sends every call to an instance (P and D legs, health checks, probes, scrapes, pass-through
requests) through one :class:`ConnectionPool`. A call is one request with its body in memory,
answered by a vLLM instance's uvicorn; httpx's and aiohttp's clients spent more CPU on each than the
rest of the router's own per-request work (docs/benchmarks/README.md, "Upstream HTTP stack"), for
features a call to an instance never uses (redirects, cookies, compression, multipart, proxies).
Here a connection's protocol feeds what it receives to ``httptools.HttpResponseParser`` (uvicorn's
parser: chunked bodies decoded there) and its reader waits on one future; nothing else runs per
chunk. An ``https`` instance is reached over TLS (the system's default certificate store, the host
name checked).

Errors are :class:`TransportError`'s (callers translate them:
:func:`disagg_router.router.upstream.calls._translate`): :class:`ConnectError` /
:class:`ConnectTimeout` before the request is written, :class:`ReadTimeout` when ``read_timeout``
passes with nothing received, :class:`RemoteProtocolError` when the instance closes the connection
before its answer ends or sends what is not HTTP/1.1 (:class:`AnswerHeadersTooLarge`, one of them,
when the answer's headers exceed :data:`MAX_ANSWER_HEAD_BYTES`). A connection goes back to the pool
only when its answer was read to the end and both sides keep it alive; one idle longer than
``keepalive_s``, or than the instance's own ``Keep-Alive: timeout=N`` less a margin, is closed, not
reused.

The idle-close race: a server (or a proxy in between) may close an idle connection just as a
request is written on it. A request whose *reused* connection fails before a single byte of the
answer arrived is sent once more on a new connection to the same origin (:class:`Call`),
as every pooling client does: an HTTP/1.1 server answers or closes, and one that closed an idle
connection never read the request. Nothing else is retried here: not a failure on a new
connection, not one after any byte of the answer, not a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import Callable
from types import TracebackType
from typing import cast

import httptools

log = logging.getLogger(__name__)

Origin = tuple[str, int, bool]
"""(host, port, TLS) of an instance: ``True`` for an ``https`` one."""


def _ignore(origin: Origin) -> None:
    """The default :attr:`ConnectionPool.on_stale_retry`: nobody counts."""


MAX_ANSWER_HEAD_BYTES = 65536
"""The most bytes an upstream answer's header lines may take (names and values): the one bound
on every upstream answer (all lines together)."""

KEEPALIVE_MARGIN_S = 1.0
"""How long before an instance's announced ``Keep-Alive: timeout=N`` an idle connection is
given up (at most half of N)."""


class TransportError(Exception):
    """A call to an instance failed below HTTP: the one base of this module's errors."""


class ConnectError(TransportError):
    """The connection could not be opened (refused, unreachable, TLS handshake failed)."""


class ConnectTimeout(TransportError):
    """Opening the connection (or waiting for room to open one) took the connect timeout."""


class ReadTimeout(TransportError):
    """The read timeout passed with nothing received."""


class RemoteProtocolError(TransportError):
    """The instance closed the connection before its answer ended, or sent no valid answer."""


class AnswerHeadersTooLarge(RemoteProtocolError):
    """An instance's answer whose headers exceed :data:`MAX_ANSWER_HEAD_BYTES`."""

    def __init__(self) -> None:
        super().__init__(f"the answer's headers exceed {MAX_ANSWER_HEAD_BYTES} bytes")


def _name(origin: Origin) -> str:
    """``host:port`` of ``origin``, for error messages and logs."""
    return f"{origin[0]}:{origin[1]}"


def keepalive_timeout(value: bytes) -> float | None:
    """The ``timeout=N`` of a ``Keep-Alive`` header's value, or None if it has none."""
    for part in value.split(b","):
        name, _, number = part.strip().partition(b"=")
        if name.strip().lower() == b"timeout":
            try:
                found = float(number.strip())
            except ValueError:
                return None
            return found if found >= 0 else None
    return None


_PAUSE_AT = 1 << 20
"""Bytes read and not yet taken by the reader (body bytes and their chunk framing) at which a
connection stops reading from its socket until the reader catches up (a slow client of the
router must not make it buffer a whole answer)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one origin, serving one request at a time: the answer's
    head, then its body, to one reader (the leg's task). Made by :class:`ConnectionPool`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        origin: Origin,
        read_timeout: float | None,
        on_lost: Callable[[_Connection], None],
    ) -> None:
        self._loop = loop
        self.origin = origin
        self.read_timeout = read_timeout
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self.on_body: Callable[[bytes], None] = self._chunks.append
        """The parser's body callback: each decoded chunk straight onto the deque, no Python
        call per chunk (httptools looks its callbacks up once, when the parser is made)."""
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait_started = 0.0
        self._buffered = 0
        self._paused = False
        self._error: Exception | None = None
        self.closed = False
        self.idle_since = 0.0
        self.status = 0
        self.content_type = ""
        self._headed = False
        self._complete = False
        self._keep_alive = False
        self._active = False
        self._head_bytes = 0
        self._received = False
        self.reused = False
        """Whether the request under way was written on a connection taken from the idle ones."""
        self.keepalive_limit: float | None = None
        """The instance's ``Keep-Alive: timeout=N`` (seconds), once an answer has said it."""

    # asyncio.Protocol: called by the event loop, never by the router.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if not self._active:  # bytes nobody asked for (past an answer: on_message_begin)
            self._fail(RemoteProtocolError("data received on an idle connection"))
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            too_large = self._head_bytes > MAX_ANSWER_HEAD_BYTES
            error = AnswerHeadersTooLarge() if too_large else None
            self._fail(error or RemoteProtocolError(f"invalid HTTP answer: {exc}"))
            return
        chunks = self._chunks
        if chunks and self._sink is not None:  # spliced: the bytes go on in this callback
            body = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._wait_started = self._loop.time()  # bytes came: the reader's wait starts again
            self._sink(body)
        elif chunks:  # body bytes came: the reader is woken once per read, not per chunk
            self._buffered += len(data)
            if self._buffered >= _PAUSE_AT and not self._paused and self._transport is not None:
                self._paused = True
                self._transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._active and not self._complete and self._error is None:
            reason = "server disconnected before the answer ended"
            self._error = RemoteProtocolError(reason if exc is None else f"{reason}: {exc}")
        self._wake()
        self._on_lost(self)

    def pause_writing(self) -> None:  # a request body is written at once; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # httptools.HttpResponseParser callbacks.

    def on_message_begin(self) -> None:
        if self._complete:  # a second answer to one request: stop parsing here
            raise ValueError("bytes past the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_ANSWER_HEAD_BYTES:
            raise ValueError("the answer's headers are too large")  # data_received names it
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lower == b"keep-alive":
            self.keepalive_limit = keepalive_timeout(value)

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self._headed = True
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # The leg's side: one request, its head, its body.

    def send(self, head: bytes, body: bytes) -> None:
        """Write one request (``head`` ends with the blank line); the answer is read next."""
        assert self._transport is not None and not self._active
        self._active = True
        self._headed = self._complete = self._received = False
        self.status, self.content_type, self._head_bytes = 0, "", 0
        if len(body) < 65536:  # one segment; a large body is not copied onto the head
            self._transport.write(head + body)
        else:
            self._transport.write(head)
            self._transport.write(body)

    async def head(self) -> None:
        """Wait for the answer's status line and headers (``status``, ``content_type``)."""
        while not self._headed:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body (what is left of it)."""
        parts: list[bytes] = []
        while True:
            chunk = await self.read_chunk()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def read_chunk(self) -> bytes:
        """The body bytes received since the last call, all of them (never empty; the chunks
        of one read from the socket come back together, so a stream's events read at once are
        handled at once); ``b""`` once the body has ended."""
        chunks = self._chunks
        while not chunks:
            if self._complete:
                return b""
            await self._wait()
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return data

    def splice(self, sink: Callable[[bytes], None] | None) -> bool:
        """Hand the body's bytes to ``sink`` as they are received, from the event loop's
        callback, instead of waking the reader (``None``: back to the reader). Taken only while
        the body is under way and nothing waits in the buffer for the reader, so no byte is
        handed on out of order; returns whether it was. The reader still learns of the body's
        end and of a failure; while spliced, each read restarts its read timeout.

        Who calls it: the relay of a streamed answer (through
        :meth:`disagg_router.router.upstream.sse.EventReader.splice`), while the reader waits.
        ``sink`` must not raise or block; it may call ``splice(None)``. The request's end
        (:meth:`finish`, :meth:`close`) drops it."""
        if sink is None:
            self._sink = None
            return True
        if not (self._active and self._headed) or self._chunks or self._complete or self._error:
            return False
        self._sink = sink
        return True

    @property
    def stale(self) -> bool:
        """Whether the request under way may be sent again on a new connection after this one
        failed: it was reused, and not a byte of the answer arrived (the idle-close race)."""
        return self.reused and not self._received

    def reusable(self) -> bool:
        """Whether the answer was read to its end on a connection both sides keep alive."""
        return self._complete and self._keep_alive and not self.closed and not self._chunks

    def finish(self) -> None:
        """The request is over (read or not): ready for the next, or closed by :meth:`close`."""
        self._active = False
        self._sink = None
        self._stop_timer()

    def close(self) -> None:
        self.closed = True
        self._sink = None
        self._stop_timer()
        if self._transport is not None:
            self._transport.close()

    async def _wait(self) -> None:
        """Until the protocol has news (``ReadTimeout`` when ``read_timeout`` passes first).
        The connection's error is raised only when there is nothing left to read: what arrived
        before the connection failed is still the caller's.

        One timer per request, not one per wait: it is armed by the first wait and, when it
        fires, re-armed for what is left of the current wait (:meth:`_check_timeout`)."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        if self.read_timeout is not None:
            self._wait_started = self._loop.time()
            if self._timer is None:
                due = self._wait_started + self.read_timeout
                self._timer = self._loop.call_at(due, self._check_timeout)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_timeout(self) -> None:
        """The read timer: fail the wait under way if it has lasted ``read_timeout``, else wait
        for what is left of it (no wait under way: the next one arms a new timer)."""
        self._timer = None
        waiter, limit = self._waiter, self.read_timeout
        if waiter is None or waiter.done() or limit is None:
            return
        due = self._wait_started + limit
        if self._loop.time() >= due:
            waiter.set_exception(ReadTimeout("timed out waiting for the answer"))
        else:
            self._timer = self._loop.call_at(due, self._check_timeout)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self.close()
        self._wake()


class ConnectionPool:
    """Idle keep-alive connections per origin, at most ``max_connections`` open in all (a
    request beyond waits for one to close or come back, up to ``connect_timeout``). Made once per
    :class:`UpstreamClient`; used on the event loop that made it; :meth:`close` once at the end."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float | None,
        keepalive_s: float,
        max_connections: int,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._count = 0
        """Open connections and connections being opened (at most ``max_connections``)."""
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False
        self._ssl: ssl.SSLContext | None = None
        self.on_stale_retry: Callable[[Origin], None] = _ignore
        """Told each time a request is sent again after the idle-close race (the router counts
        it); set by the client's owner, must not raise."""

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection (``max_connections`` are open)."""
        return sum(not waiter.done() for waiter in self._slot_waiters)

    def request(self, origin: Origin, head: bytes, body: bytes = b"") -> Call:
        """One request (``head``: its request line and headers up to the blank line) as an async
        context manager (see :class:`Call`)."""
        return Call(self, origin, head, body)

    async def acquire(self, origin: Origin, fresh: bool = False) -> _Connection:
        """An idle connection to ``origin`` still fresh (unless ``fresh``), else a new one
        (waiting, up to the connect timeout, while ``max_connections`` are open). Raises
        ``RuntimeError`` once closed, :class:`ConnectError` / :class:`ConnectTimeout`."""
        if self.closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        conn = None if fresh else self._take_idle(origin)
        if conn is not None:
            conn.reused = True
            return conn
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self._open_one(origin)
        except TimeoutError as exc:
            raise ConnectTimeout(f"connect to {_name(origin)} timed out") from exc

    def release(self, conn: _Connection) -> None:
        """``conn``'s request is over: back to the pool if reusable (a request waiting for a
        connection is woken), else closed."""
        conn.finish()
        if conn.reusable() and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.origin, []).append(conn)
            self._wake_one()
        else:
            self._discard(conn)

    async def close(self) -> None:
        """Close every connection; a request after this raises ``RuntimeError``."""
        self.closed = True
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()

    def _take_idle(self, origin: Origin) -> _Connection | None:
        """The most recently used idle connection to ``origin`` still fresh; the stale ones
        met on the way are closed."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_of(conn):
                return conn
            self._discard(conn)
        return None

    def _keepalive_of(self, conn: _Connection) -> float:
        """How long ``conn`` may stay idle: ``keepalive_s``, or less where the instance said
        ``Keep-Alive: timeout=N`` (N less a margin of at most half of it)."""
        announced = conn.keepalive_limit
        if announced is None:
            return self.keepalive_s
        return min(self.keepalive_s, announced - min(KEEPALIVE_MARGIN_S, announced / 2))

    async def _open_one(self, origin: Origin) -> _Connection:
        """A new connection to ``origin`` once there is room: an idle connection elsewhere is
        closed to make it, else this waits for one to be closed or come back idle."""
        loop = asyncio.get_running_loop()
        while self._count >= self.max_connections:
            if not self._evict_idle():
                waiter = loop.create_future()
                self._slot_waiters.append(waiter)
                try:
                    await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled():
                        self._wake_one()  # woken, then cancelled: the next one takes the room
                    raise
                conn = self._take_idle(origin)
                if conn is not None:
                    conn.reused = True
                    return conn
        self._count += 1  # counted while connecting, so concurrent connects keep the limit
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(loop, origin, self.read_timeout, self._lost),
                origin[0],
                origin[1],
                ssl=self._tls() if origin[2] else None,
            )
        except OSError as exc:  # ssl.SSLError included: a failed handshake is a failed connect
            self._count -= 1
            self._wake_one()
            raise ConnectError(f"connect to {_name(origin)}: {exc}") from exc
        except BaseException:
            self._count -= 1
            self._wake_one()
            raise
        self._open.add(conn)
        return conn

    def _tls(self) -> ssl.SSLContext:
        """The TLS settings of ``https`` connections, made on first use."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _evict_idle(self) -> bool:
        """Close one idle connection (any origin) to make room; False if none is idle."""
        for idle in self._idle.values():
            if idle:
                self._discard(idle.pop(0))
                return True
        return False

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._lost(conn)

    def _lost(self, conn: _Connection) -> None:
        """``conn`` is closed (by us, or by the instance while idle): it no longer counts, and
        one request waiting for a connection may open one."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        self._count -= 1
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Call:
    """One request on a pooled connection as an async context manager: entering writes the request
    and waits for the answer's head (the answer, a
    :class:`disagg_router.router.upstream.client.Answer`); its body is read inside the block; on
    exit the connection goes back to the pool if the body was read to its end, else it is closed
    (never awaits: a cancellation cannot skip it)."""

    def __init__(self, pool: ConnectionPool, origin: Origin, head: bytes, body: bytes) -> None:
        self._pool = pool
        self._request = (origin, head, body)
        self._conn: _Connection | None = None

    async def __aenter__(self) -> _Connection:
        origin = self._request[0]
        conn = await self._pool.acquire(origin)
        try:
            return await self._start(conn)
        except RemoteProtocolError as exc:
            if not conn.stale:
                raise
            log.debug("%s closed a kept-alive connection (%s): sent again", _name(origin), exc)
        self._pool.on_stale_retry(origin)
        return await self._start(await self._pool.acquire(origin, fresh=True))

    async def _start(self, conn: _Connection) -> _Connection:
        """Write the request on ``conn`` and wait for the answer's head; on any failure the
        connection is closed (released unread) and the error raised."""
        _, head, body = self._request
        self._conn = conn
        try:
            conn.send(head, body)
            await conn.head()
        except BaseException:
            self._conn = None
            self._pool.release(conn)  # unread: closed
            raise
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
